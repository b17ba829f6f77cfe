"""The privacy ledger: one immutable record per noisy release.

Each record carries a dp-accounting event (``GaussianDpEvent`` and friends) plus what a
reader needs to audit it: the per-unit bound, the noise actually added, and which units
the release touched. Accounting is a separate step (:mod:`fedpers.privacy.accountant`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import attr
import dp_accounting

ALL_UNITS = "all"


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PureDpEvent(dp_accounting.DpEvent):
    """An ε-DP mechanism with δ = 0 (the exponential mechanism); dp-accounting has no such event.

    An attrs class like dp-accounting's own events, so it serialises with their round trip."""

    epsilon: float


@attr.s(frozen=True, slots=True, auto_attribs=True)
class EpsilonDeltaDpEvent(dp_accounting.DpEvent):
    """A mechanism whose only known guarantee is a stated (ε, δ)-DP bound (DPCovariance).

    dp-accounting has no such event. The accountant composes it in PLD through the
    worst-case privacy-loss distribution of an (ε, δ)-DP mechanism (tight for that
    guarantee); RDP and zCDP have no representation of it, so there it is added by basic
    composition (ε's and δ's add).
    """

    epsilon: float
    delta: float


@dataclass(frozen=True)
class Release:
    """One noisy release. ``units`` is ``"all"`` or the label of a disjoint group (e.g. ``"cohort:3"``).

    ``sensitivity`` is the L2 sensitivity under ``neighbours``, the relation the release is
    accounted for: replace-one (2 × ``per_unit_bound`` in general, √2 × for an unsampled sum of PSD
    per-unit matrices) or add-remove (1 ×). ``params`` holds the public inputs the bound was
    computed from (clip constants, the bound's formula, the cohort permutation's digest), so
    a reader can recompute every sensitivity from the configuration alone. A ledger written before
    the relation was recorded reads as replace-one, the only relation fedpers had.
    """

    round: int
    name: str
    mechanism: str
    per_unit_bound: float
    sensitivity: float
    noise_std: float
    units: str
    event: dp_accounting.DpEvent
    params: dict[str, Any] = dataclasses.field(default_factory=dict, compare=True)
    neighbours: str = "replace-one"

    @property
    def noise_multiplier(self) -> float:
        """2σ / sensitivity (dp-accounting's convention; σ / per-unit bound unless the bound is
        tightened, e.g. for PSD units); ∞ for a pure-ε mechanism."""
        event = self.event
        if isinstance(event, dp_accounting.PoissonSampledDpEvent):  # the mechanism run on the sample
            event = event.event
        if isinstance(event, dp_accounting.GaussianDpEvent):
            return event.noise_multiplier
        if isinstance(event, SkellamDpEvent) and event.l2_sensitivity > 0:
            return 2 * math.sqrt(event.variance) / event.l2_sensitivity  # σ over Δ/2, in integer units
        return math.inf

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "event"}
        out["event"] = event_to_dict(self.event)
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Release:
        return Release(**{**d, "event": event_from_dict(d["event"]), "params": dict(d.get("params", {}))})


EVENT_MODULES = frozenset({"dp_accounting.dp_event", __name__})
"""Modules a serialised event may name: reading a ledger never imports anything else."""


def event_to_dict(event: dp_accounting.DpEvent) -> dict[str, Any]:
    """JSON form of a dp-accounting event by the library's own round trip
    (``DpEvent.to_named_tuple``): ``{"module_name", "class_name", <fields>}``, nested for
    compositions and sampling."""
    return _plain(event.to_named_tuple())


def _plain(value: Any) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {k: _plain(getattr(value, k)) for k in value._fields}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def event_from_dict(d: dict[str, Any]) -> dp_accounting.DpEvent:
    """Inverse of :func:`event_to_dict` (``DpEvent.from_named_tuple``); also reads the ledgers
    written before fedpers used the library's form (``{"type": "gaussian", ...}``)."""
    if "type" in d:
        return _legacy_event(d)
    event = dp_accounting.DpEvent.from_named_tuple(_named(d))
    if not isinstance(event, dp_accounting.DpEvent):
        raise ValueError(f"not a dp event: {d!r}")
    return event


def _named(value: Any) -> Any:
    if isinstance(value, dict):
        module, name = value.get("module_name"), value.get("class_name")
        if module not in EVENT_MODULES or not isinstance(name, str) or not name.endswith("DpEvent"):
            raise ValueError(f"unknown dp event {module}.{name}; expected a dp_accounting or fedpers DpEvent")
        fields = {k: _named(v) for k, v in value.items()}
        return collections.namedtuple(f"_{name}Tuple", list(fields))(**fields)
    if isinstance(value, list):
        return [_named(v) for v in value]
    return value


def _legacy_event(d: dict[str, Any]) -> dp_accounting.DpEvent:
    kind = d["type"]
    if kind == "gaussian":
        return dp_accounting.GaussianDpEvent(float(d["noise_multiplier"]))
    if kind == "pure":
        return PureDpEvent(float(d["epsilon"]))
    if kind == "epsilon_delta":
        return EpsilonDeltaDpEvent(float(d["epsilon"]), float(d["delta"]))
    if kind == "non_private":
        return dp_accounting.NonPrivateDpEvent()
    if kind == "poisson_sampled":
        return dp_accounting.PoissonSampledDpEvent(float(d["sampling_probability"]), _legacy_event(d["event"]))
    raise ValueError(
        f"unknown dp event type {kind!r}; expected gaussian, pure, epsilon_delta, non_private or poisson_sampled"
    )


class Ledger:
    """Append-only list of releases (a release is validated before it is appended)."""

    def __init__(self, releases: list[Release] | None = None) -> None:
        self._releases: list[Release] = list(releases or [])
        self._recorded: list[dict[str, Any]] = []
        self._encode: Callable[[Release], Any] = Release.to_dict
        self.on_append: Callable[[Release], None] | None = None
        """Called with each release as it is appended (a run directory writes it to disk)."""

    def expect(self, recorded: list[dict[str, Any]], encode: Callable[[Release], Any]) -> None:
        """A resumed run: ``recorded`` (as written to disk) are releases drawn after the last
        checkpoint and never published. The next appends re-draw them; one whose ``encode`` equals
        the next recorded entry is kept once (``on_append`` is not called again). On the first
        mismatch every recorded entry is accounted as well (never dropped) before the new one."""
        self._recorded = list(recorded)
        self._encode = encode

    def append(self, release: Release) -> None:
        if not isinstance(release, Release):
            raise TypeError(f"expected a Release, got {type(release).__name__}")
        if self._recorded:
            if self._encode(release) == self._recorded[0]:
                self._recorded.pop(0)
                self._releases.append(release)
                return
            self.settle()
        self._releases.append(release)
        if self.on_append is not None:
            self.on_append(release)

    def settle(self) -> None:
        """Account every recorded release that a resumed run did not re-draw (never drop one)."""
        self._releases.extend(Release.from_dict(d) for d in self._recorded)
        self._recorded = []

    def __iter__(self) -> Iterator[Release]:
        return iter(self._releases)

    def __len__(self) -> int:
        return len(self._releases)

    @property
    def releases(self) -> tuple[Release, ...]:
        return tuple(self._releases)

    def groups(self) -> list[str]:
        """Disjoint unit groups that some release touched (not ``all``)."""
        return sorted({r.units for r in self._releases if r.units != ALL_UNITS})

    def touching(self, group: str) -> list[Release]:
        """Releases that touch a unit of ``group``: the group's own and every ``all`` release."""
        return [r for r in self._releases if r.units in (ALL_UNITS, group)]

    def to_json(self) -> str:
        return json.dumps([r.to_dict() for r in self._releases], indent=1)

    @staticmethod
    def from_json(text: str) -> Ledger:
        return Ledger([Release.from_dict(d) for d in json.loads(text)])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ledger) and self._releases == other._releases


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SkellamDpEvent(dp_accounting.DpEvent):
    """The multi-dimensional Skellam mechanism on integers (distributed DP): integer inputs whose
    replace-one neighbours differ by at most ``l2_sensitivity`` in L2 and ``l1_sensitivity`` in L1,
    plus Skellam noise of total ``variance`` per coordinate. dp-accounting has no such event; the
    accountant composes it by the RDP bound of Agarwal, Kairouz & Liu 2021
    (:mod:`fedpers.privacy.skellam`)."""

    variance: float
    l2_sensitivity: float
    l1_sensitivity: float
