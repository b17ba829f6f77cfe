"""Frozen, typed configurations: built from TOML or the command line, validated at the boundary.

Each field may carry ``meta(...)``: help text and a numeric range. :func:`build` coerces
strings (enums, ``inf``), then :func:`validate` refuses any value outside its range with a
message that names the field and the allowed range. Numbers must be finite unless the
field says ``inf_ok`` (ε = inf means "no noise"), and a boolean is never a number.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, dataclass_transform

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")

DEFAULT_DELTA = 1e-5
"""The one default δ of every (ε, δ) algorithm: a constant, not a rule in the number of units n,
because n of a data file is not public (a δ read off the data would itself leak), and 1e-5 is below
1/n for every default task (n ≤ 20,000 units). A run on more units should pass ``--delta`` below 1/n.
Accounting is PLD by default everywhere (``DEFAULT_ACCOUNTANT``); a flag asks for another."""

DEFAULT_ACCOUNTANT = "pld"
"""The default accountant of every algorithm that offers a choice (exact for Gaussian mechanisms)."""


class PreconditionFailed(RuntimeError):
    """A precondition of a run's privacy guarantee that only the data decide failed, so the release
    it guards was not made: the run fails (``fedpers`` exits 3) instead of publishing a result
    without its DP claim. One the declared values decide is refused before any work (ValueError)."""


MAX_EPSILON = 100.0
"""Largest finite ε a run accepts: beyond it no meaningful guarantee remains, and the PLD
accountant's discretisation of the tiny noise it calibrates takes minutes (ε = 300: 55 s and
1 GiB; ε = 1000: > 5 min). ``inf`` runs the clipped protocol without noise."""


def meta(
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    flag: str | None = None,
    inf_ok: bool = False,
    words: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``words`` maps spellings a user may give (e.g. ``auto``) to the field's value for them."""
    return {
        "help": help,
        "gt": gt,
        "ge": ge,
        "lt": lt,
        "le": le,
        "flag": flag,
        "inf_ok": inf_ok,
        "words": dict(words or {}),
    }


def field(default: Any, help: str, **bounds: Any) -> Any:
    """A config field: its default, its help text and the range :func:`validate` holds it to."""
    return dataclasses.field(default=default, metadata=meta(help, **bounds))


def _range_text(m: Mapping[str, Any]) -> str:
    lo = f"> {m['gt']}" if m.get("gt") is not None else (f">= {m['ge']}" if m.get("ge") is not None else "")
    hi = f"< {m['lt']}" if m.get("lt") is not None else (f"<= {m['le']}" if m.get("le") is not None else "")
    text = " and ".join(p for p in (lo, hi) if p) or "any finite value"
    return text + (", or inf" if m.get("inf_ok") else "")


def field_types(cls: type) -> dict[str, Any]:
    """Each field's type, resolved (the config modules use postponed annotations)."""
    return typing.get_type_hints(cls)


def _coerce(name: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None:
        return None
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        tp = args[0]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value.value if isinstance(value, enum.Enum) else value)
        except ValueError:
            allowed = ", ".join(e.value for e in tp)
            raise ValueError(f"{name} must be one of {allowed}; got {value!r}") from None
    try:
        if isinstance(value, bool) and tp in (int, float):
            raise ValueError
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes"):
                    return True
                if value.lower() in ("0", "false", "no"):
                    return False
                raise ValueError
            return bool(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if tp is Path:
            return Path(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be of type {getattr(tp, '__name__', tp)}; got {value!r}") from None
    return value


def coerce_value(name: str, tp: Any, value: Any) -> Any:
    """``value`` (e.g. a command-line string) as type ``tp``; ValueError naming ``name`` otherwise."""
    return _coerce(name, tp, value)


def check_range(name: str, value: Any, m: Mapping[str, Any]) -> None:
    """Refuse a number outside the range ``m`` (a field's :func:`meta`) declares; other values pass."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{name} must be a number ({_range_text(m)}); got nan")
    if isinstance(value, float) and math.isinf(value):
        if m.get("inf_ok") and value > 0:
            return
        raise ValueError(f"{name} must be finite ({_range_text(m)}); got {value}")
    bad = (
        (m.get("gt") is not None and not value > m["gt"])
        or (m.get("ge") is not None and not value >= m["ge"])
        or (m.get("lt") is not None and not value < m["lt"])
        or (m.get("le") is not None and not value <= m["le"])
    )
    if bad:
        raise ValueError(f"{name} must be {_range_text(m)}; got {value}")


def validate(cfg: DataclassInstance) -> None:
    """Refuse values outside each field's declared range (NaN is refused everywhere)."""
    for f in dataclasses.fields(cfg):
        check_range(f.name, getattr(cfg, f.name), f.metadata)
    check = getattr(cfg, "check", None)
    if check is not None:
        check()


def build(cls: type[D], values: Mapping[str, Any]) -> D:
    """Coerce ``values`` to ``cls``'s field types, construct, and validate. Unknown keys are refused."""
    types = field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    defaults_for = getattr(cls, "defaults_for", None)  # defaults that depend on other fields' values
    if defaults_for is not None:
        values = {**defaults_for(values), **values}
    words = {f.name: f.metadata.get("words") or {} for f in dataclasses.fields(cls)}
    values = {k: words[k].get(v, v) if isinstance(v, str) else v for k, v in values.items()}
    cfg = cls(**{k: _coerce(k, types[k], v) for k, v in values.items()})
    validate(cfg)
    return cfg


def to_dict(cfg: DataclassInstance) -> dict[str, Any]:
    """Plain JSON/TOML-friendly dict (enums as values, paths as strings, inf as the string 'inf')."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, enum.Enum):
            v = v.value
        elif isinstance(v, Path):
            v = str(v)
        elif isinstance(v, float) and math.isinf(v):
            v = "inf" if v > 0 else "-inf"
        out[f.name] = v
    return out


def check_device_and_dtype(device: str, dtype: str) -> None:
    """Refuse a device other than cpu/cuda[:i] (or cuda without a GPU) and a dtype other than float32/float64.
    Only a cuda device imports torch (to ask for one): a config's check stays light on the CPU."""
    if dtype not in ("float64", "float32"):
        raise ValueError(f"dtype must be float64 or float32; got {dtype!r}")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be cpu or cuda[:i]; got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but no CUDA device is available")


KERNELS = ("auto", "device", "host")
"""Code paths: ``device`` keeps data, statistics and solves as a few large batched kernels on the
run's device (users drawn there from (seed, user id)); ``host`` is the CPU path; ``auto`` picks
``device`` on cuda and ``host`` on cpu. ``--kernels device --device cpu`` runs the GPU path on
CPU tensors, which is how CI (no GPU) tests it against the host path."""


def check_kernels(kernels: str) -> None:
    """Refuse a code path other than those in ``KERNELS``."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")


def device_path(device: str, kernels: str = "auto") -> bool:
    """Whether a run takes the device code path (see ``KERNELS``)."""
    check_kernels(kernels)
    return kernels == "device" or (kernels == "auto" and device.startswith("cuda"))


class _Inherited:
    """Marks a field a run config takes as declared elsewhere (see :func:`inherited`)."""

    def __init__(self, source: type | None) -> None:
        self.source = source


def inherited(source: type | None = None) -> Any:
    """``name: type = inherited()`` in a :func:`run_config` class: the field its base declares (the
    same default, help and range), listed at this place of the config's own order. ``source``: take
    it from that run config instead (a sibling that declares the same field)."""
    return _Inherited(source)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def run_config(cls: type[T]) -> type[T]:
    """A frozen dataclass of an algorithm's config whose fields keep the order its class lists them in.

    Every field is listed, the inherited ones too (``seed: int = inherited()``): the order is the
    one ``--help`` shows, config.json holds and a checkpoint's digest covers, so it stays the
    config's own instead of base fields first. Re-declaring a base field with :func:`field`
    changes its default or help text (dataclasses allow it); its type stays the base's.
    """
    own = list(inspect.get_annotations(cls))
    declared: dict[str, dataclasses.Field[Any]] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            declared.update({f.name: f for f in dataclasses.fields(base)})
    for name in own:
        mark = cls.__dict__.get(name)
        if isinstance(mark, _Inherited):
            source = declared if mark.source is None else {f.name: f for f in dataclasses.fields(mark.source)}
            if name not in source:
                raise TypeError(f"{cls.__name__}.{name} = inherited(): no base or source declares {name}")
            metadata = dict(source[name].metadata)
            setattr(cls, name, dataclasses.field(default=source[name].default, metadata=metadata))
    unlisted = [name for name in declared if name not in own]
    if unlisted:
        raise TypeError(
            f"{cls.__name__} must list its inherited field(s) {', '.join(unlisted)} (name: type = inherited())"
        )
    out = dataclass(frozen=True)(cls)
    fields = vars(out)["__dataclass_fields__"]
    ordered = {name: fields[name] for name in own}
    fields.clear()
    fields.update(ordered)
    return out


class Neighbours(str, enum.Enum):
    """Which data sets are neighbours (``--neighbours``), the relation every (ε, δ) of a run is for.

    ``replace-one``: one privacy unit's whole data swapped for arbitrary other data (the papers'
    user-level notion, fedpers's default), so an L2 sensitivity is 2× the per-unit bound.
    ``add-remove``: one unit added or removed, so 1×; what Flower, pfl, Opacus and jax_privacy
    report. Without sampling, replace-one at noise multiplier z is add-remove at z/2; with Poisson
    sampling there is no such identity, and each is accounted exactly (docs/accounting.md)."""

    REPLACE_ONE = "replace-one"
    ADD_REMOVE = "add-remove"

    @property
    def sensitivity_factor(self) -> float:
        """Δ of a sum per unit of the per-unit norm bound: 2 (replace-one) or 1 (add-remove)."""
        return 2.0 if self is Neighbours.REPLACE_ONE else 1.0


def neighbours_of(value: Neighbours | str) -> Neighbours:
    """``value`` as a :class:`Neighbours`; a ValueError naming the allowed relations otherwise."""
    try:
        return Neighbours(value.value if isinstance(value, Neighbours) else value)
    except ValueError:
        allowed = ", ".join(n.value for n in Neighbours)
        raise ValueError(f"neighbours must be one of {allowed}; got {value!r}") from None


@dataclass(frozen=True)
class RunConfig:
    """What every run has, declared once: its seed, its ε, the units per chunk of the local
    runtime and the neighbouring relation its (ε, δ) is for. An algorithm's config inherits it (through :class:`ApproxDpRunConfig` or
    :class:`DeviceRunConfig` where it has those fields) and re-declares a field to change its
    default or help; the runner, the runtimes and the Flower apps read these fields typed."""

    seed: int = field(0, "run seed (data and DP noise use separate generators derived from it)", ge=0)
    epsilon: float = field(1.0, "ε of the whole run (inf: no noise)", gt=0.0, le=MAX_EPSILON, inf_ok=True)
    chunk_size: int = field(4096, "units per batch on the local runtime (bounds memory)", ge=1)
    neighbours: Neighbours = field(
        Neighbours.REPLACE_ONE,
        "neighbouring data sets: replace-one (a unit's data swapped, the papers' notion: Δ = 2·bound) or "
        "add-remove (a unit added or removed: Δ = bound; what Flower, pfl, Opacus and jax_privacy report)",
    )

    @property
    def device(self) -> str:
        """Where the run's tensors live: the host, unless the config has a ``device`` field."""
        return "cpu"

    def check(self) -> None:
        """Rules across fields, after :func:`validate` has checked each field's range (none here)."""


@dataclass(frozen=True)
class ApproxDpRunConfig(RunConfig):
    """A run with an (ε, δ) guarantee: every algorithm but the pure ε-DP exponential mechanism."""

    delta: float = field(DEFAULT_DELTA, "δ", gt=0.0, lt=1.0)


@dataclass(frozen=True)
class DeviceRunConfig(ApproxDpRunConfig):
    """An (ε, δ) run that chooses its device, the dtype of its statistics and its code path."""

    device: str = field("cpu", "torch device: cpu or cuda")
    dtype: str = field("float64", "float64 or float32 for the client statistics")
    kernels: str = field("auto", "code path: auto (device kernels on cuda, host on cpu), device, host")

    def check_device(self) -> None:
        """Refuse a device, dtype or code path this machine or torch does not have."""
        check_device_and_dtype(self.device, self.dtype)
        check_kernels(self.kernels)


class DpModel(str, enum.Enum):
    """The trust models (``--dp-model``): who adds the noise, so whom a user must trust
    (docs/privacy.md, "Three trust models")."""

    CENTRAL = "central"
    DISTRIBUTED = "distributed"
    LOCAL = "local"
