"""A run's result, typed: the sections of ``result.json`` and their one naming of noise.

:class:`RunResult` is what a finished run returns and writes; every command that shows a
result (the CLI summary, the HTML report, compare, the trackers, ``--json``) reads it from
here (rendered by :mod:`fedpers.commands.summary`). :meth:`RunResult.from_dict` reads any
``result.json`` written so far, and :meth:`RunResult.to_dict` gives it back with the same keys,
values and key order, so ``dumps(RunResult.from_dict(d).to_dict())`` is the file it came from.

The noise figures, named once (a ledger release records all four; a run's privacy section
repeats those that are one number for the whole run):

- ``per_unit_bound``: the L2 bound on one unit's (user's) clipped contribution to a sum;
- ``sensitivity`` Δ: the replace-one L2 sensitivity of the released sum (2 × the per-unit
  bound in general, √2 × for a sum of PSD per-unit matrices);
- ``noise_std`` σ: the standard deviation of the Gaussian noise added to each coordinate;
- ``noise_multiplier`` z = 2σ / Δ: dp-accounting's convention (the release is
  ``GaussianDpEvent(z)``), i.e. σ / per-unit bound unless the bound was tightened. Never
  σ / Δ (that is z / 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

Scalar = float | int | bool
"""One figure of a run: a number, or a yes/no check (``dp_claimed``, ``bound_holds``)."""

NOISE_KEYS: Final = ("per_unit_bound", "sensitivity", "noise_std", "noise_multiplier")
"""The noise figures, in the order a ledger shows them (defined in the module docstring)."""

HEADLINE: Final = ("epsilon", "delta", "noise_multiplier")
"""Privacy figures a run repeats at the top level of ``result.json``."""

Converter = Callable[[Any], Any]
"""A typed field's reader: the value as the field holds it, or ``_NOT`` where it does not fit."""

_NOT = object()
"""A converter's answer for a value that does not fit the typed field (kept as a detail)."""

_NONFINITE = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
"""How :func:`fedpers.results.rundir.dumps` writes non-finite floats, read back as floats."""


def _float(v: Any) -> Any:
    if isinstance(v, bool):
        return _NOT
    if isinstance(v, (int, float)):
        return v
    return _NONFINITE.get(v, _NOT) if isinstance(v, str) else _NOT


def _scalar(v: Any) -> Any:
    return v if isinstance(v, bool) else _float(v)


def scalar(v: Any) -> Scalar | None:
    """``v`` as a figure (a number, a check, or a non-finite float as ``dumps`` writes it); None if it is not one."""
    value = _scalar(v)
    return None if value is _NOT else value


def _str(v: Any) -> Any:
    return v if isinstance(v, str) else _NOT


def _int(v: Any) -> Any:
    return v if isinstance(v, int) and not isinstance(v, bool) else _NOT


def _strs(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v) else _NOT


def _mapping(v: Any) -> Any:
    return dict(v) if isinstance(v, Mapping) else _NOT


def _float_map(v: Any) -> Any:
    if not isinstance(v, Mapping):
        return _NOT
    out = {str(k): _float(x) for k, x in v.items()}
    return _NOT if any(x is _NOT for x in out.values()) else out


def _str_map(v: Any) -> Any:
    return dict(v) if isinstance(v, Mapping) and all(isinstance(x, str) for x in v.values()) else _NOT


def _mappings(v: Any) -> Any:
    if not isinstance(v, Mapping) or not all(isinstance(x, Mapping) for x in v.values()):
        return _NOT
    return {str(k): dict(x) for k, x in v.items()}


def _warnings(v: Any) -> Any:
    return v if isinstance(v, list) and all(isinstance(w, (str, Mapping)) for w in v) else _NOT


def _split(d: Mapping[str, Any], convert: Mapping[str, Converter]) -> dict[str, Any]:
    """Constructor arguments of a record: each key its converter accepts as a typed field, every
    other key a detail, and the keys' order as its layout."""
    typed: dict[str, Any] = {}
    details: dict[str, Any] = {}
    for k, v in d.items():
        value = convert[k](v) if k in convert else _NOT
        if value is _NOT:
            details[k] = v
        else:
            typed[k] = value
    return {**typed, "details": details, "layout": tuple(d)}


def _join(entries: Mapping[str, Any], details: Mapping[str, Any], layout: Sequence[str]) -> dict[str, Any]:
    """The record as a JSON object: its keys in ``layout`` order, then any key added since."""
    merged = {**entries, **details}
    out = {k: merged[k] for k in layout if k in merged}
    out.update((k, v) for k, v in merged.items() if k not in out)
    return out


def _present(record: Any, names: Sequence[str]) -> dict[str, Any]:
    """Typed fields that were recorded: set, or read as ``null`` (in the layout)."""
    return {n: getattr(record, n) for n in names if getattr(record, n) is not None or n in record.layout}


@dataclass(frozen=True)
class Privacy:
    """The guarantee a run proves and the noise that buys it (``result["privacy"]``).

    ``epsilon``/``delta``: what the accountant gives for the releases made (not the target);
    ``noise_multiplier`` z and the other noise figures as in the module docstring, where they
    are one number for the run. ``details``: the algorithm's own entries (bounds, formulas,
    per-mechanism stds), kept as recorded."""

    epsilon: float | None = None
    delta: float | None = None
    target_epsilon: float | None = None
    accountant: str | None = None
    neighbouring: str | None = None
    calibration: str | None = None
    dp_model: str | None = None
    """Who added the noise: central (the server), distributed (the nodes' Skellam shares), local (each unit)."""
    bits: int | None = None
    """Distributed DP: the bits of the modular sum."""
    composition: str | None = None
    """How the releases were composed into the reported (ε, δ)."""
    noise_multiplier: float | None = None
    noise_std: float | None = None
    sensitivity: float | None = None
    per_unit_bound: float | None = None
    paper_epsilon_same_noise: float | None = None
    """The ε the paper's own calibration claims for this noise (where the paper has one)."""
    epsilon_by_accountant: Mapping[str, float] | None = None
    """The same noise accounted by each accountant (where the run reports several)."""
    details: Mapping[str, Any] = field(default_factory=dict)
    layout: tuple[str, ...] = ()
    """The recorded keys' order (``to_dict`` writes them back in it)."""

    CONVERT: ClassVar[Mapping[str, Converter]] = {
        "epsilon": _float,
        "delta": _float,
        "target_epsilon": _float,
        "accountant": _str,
        "neighbouring": _str,
        "calibration": _str,
        "dp_model": _str,
        "bits": _int,
        "composition": _str,
        "noise_multiplier": _float,
        "noise_std": _float,
        "sensitivity": _float,
        "per_unit_bound": _float,
        "paper_epsilon_same_noise": _float,
        "epsilon_by_accountant": _float_map,
    }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Privacy:
        return Privacy(**_split(d, Privacy.CONVERT))

    def to_dict(self) -> dict[str, Any]:
        entries = _present(self, list(Privacy.CONVERT))
        if entries.get("epsilon_by_accountant") is not None:
            entries["epsilon_by_accountant"] = dict(entries["epsilon_by_accountant"])
        return _join(entries, self.details, self.layout)


@dataclass(frozen=True)
class ResultWarning:
    """A private result no better than a trivial one (``result["warnings"]``): ``text`` says
    which and what to change; the others give the two values compared."""

    text: str
    metric: str | None = None
    private: float | None = None
    baseline: str | None = None
    baseline_value: float | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    layout: tuple[str, ...] = ()

    CONVERT: ClassVar[Mapping[str, Converter]] = {
        "metric": _str,
        "private": _float,
        "baseline": _str,
        "baseline_value": _float,
        "text": _str,
    }

    @staticmethod
    def from_dict(d: Mapping[str, Any] | str) -> ResultWarning | str:
        """A recorded warning; a plain-text one stays text."""
        if isinstance(d, str):
            return d
        parts = _split(d, ResultWarning.CONVERT)
        if "text" not in parts:
            parts["text"] = ""
        return ResultWarning(**parts)

    def to_dict(self) -> dict[str, Any]:
        entries = _present(self, [n for n in ResultWarning.CONVERT if n != "text"])
        if "text" in self.layout or not self.layout:
            entries["text"] = self.text
        return _join(entries, self.details, self.layout)


def warning_text(w: ResultWarning | str) -> str:
    return w if isinstance(w, str) else w.text


@dataclass(frozen=True)
class RunResult:
    """One run's result (``result.json``), by section.

    ``metrics``: the private run's final figures (numbers and yes/no checks), in the order the
    evaluator gave them; ``baselines``: each baseline's metrics by name; ``privacy``: the
    guarantee and the noise (:class:`Privacy`), its ``headline`` figures repeated at the top
    level; ``data``: the input's summary (where the run read a data file); ``conditions``: the
    preconditions of the guarantee a run checks (each ``holds`` and its ``text``; a value
    decided on the data is never written); ``warnings``; ``seconds``: the run's wall time; ``details``: the algorithm's
    other entries (lists, texts), kept as recorded."""

    algorithm: str
    status: str = "completed"
    runtime: str = "local"
    metrics: Mapping[str, Scalar] = field(default_factory=dict)
    baselines: Mapping[str, Mapping[str, Any]] | None = None
    baselines_skipped: tuple[str, ...] | None = None
    privacy: Privacy | None = None
    headline: tuple[str, ...] = ()
    """Which of :data:`HEADLINE` the top level repeats from ``privacy``."""
    data: Mapping[str, Any] | None = None
    conditions: Mapping[str, Mapping[str, Any]] | None = None
    skipped_metrics: Mapping[str, str] | None = None
    """Metrics the run could not compute, with why (e.g. a data file without the truth)."""
    refused_because: tuple[str, ...] | None = None
    """The preconditions that failed, where a run refuses to claim DP."""
    warnings: tuple[ResultWarning | str, ...] | None = None
    seconds: float | None = None
    plots: tuple[str, ...] | None = None
    run_dir: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    layout: tuple[str, ...] = ()
    """The recorded keys' order (``to_dict`` writes them back in it; keys set later follow)."""

    CONVERT: ClassVar[Mapping[str, Converter]] = {
        "algorithm": _str,
        "status": _str,
        "runtime": _str,
        "baselines": _mappings,
        "baselines_skipped": _strs,
        "privacy": _mapping,
        "data": _mapping,
        "conditions": _mappings,
        "skipped_metrics": _str_map,
        "refused_because": _strs,
        "warnings": _warnings,
        "seconds": _float,
        "plots": _strs,
        "run_dir": _str,
    }
    SECTIONS: ClassVar = ("baselines", "baselines_skipped", "data", "conditions", "skipped_metrics", "refused_because")
    TAIL: ClassVar = ("privacy", "seconds", "warnings", "plots", "run_dir")

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RunResult:
        """Read a result (``result.json``, or the dict a run returns) section by section; the
        run's in-memory extras (``_rounds``, ``_state``) stay details, never metrics."""
        parts = _split(d, RunResult.CONVERT)
        details: dict[str, Any] = parts.pop("details")
        privacy = Privacy.from_dict(parts.pop("privacy")) if "privacy" in parts else None
        recorded = d["privacy"] if privacy is not None else {}
        headline = tuple(k for k in HEADLINE if k in details and k in recorded and details[k] == recorded[k])
        metrics: dict[str, Scalar] = {}
        for k in list(details):
            if k in headline:
                del details[k]
            elif k not in HEADLINE and not k.startswith("_") and _scalar(details[k]) is not _NOT:
                metrics[k] = _scalar(details.pop(k))
        if "warnings" in parts:
            parts["warnings"] = tuple(ResultWarning.from_dict(w) for w in parts["warnings"])
        parts.setdefault("algorithm", "?")
        return RunResult(**parts, privacy=privacy, headline=headline, metrics=metrics, details=details)

    @staticmethod
    def completed(
        algorithm: str, runtime: str, privacy: Mapping[str, Any], final: Mapping[str, Any], seconds: float
    ) -> RunResult:
        """A finished run's result: the headline privacy figures, the evaluator's ``final``
        (metrics and sections), the privacy section and the time, in the order result.json
        has always held them."""
        return RunResult.from_dict(
            {
                "algorithm": algorithm,
                "status": "completed",
                "runtime": runtime,
                **{k: privacy[k] for k in HEADLINE if k in privacy},
                **final,
                "privacy": privacy,
                "seconds": seconds,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``result.json`` holds (non-finite floats as floats: ``dumps`` writes them)."""
        entries: dict[str, Any] = {"algorithm": self.algorithm, "status": self.status, "runtime": self.runtime}
        recorded = self.privacy.to_dict() if self.privacy is not None else {}
        entries.update((k, recorded[k]) for k in self.headline if k in recorded)
        entries.update(self.metrics)
        for name, value in _present(self, [*self.SECTIONS, *self.TAIL]).items():
            entries[name] = _plain(value)
        if "privacy" in entries:
            entries["privacy"] = recorded
        if self.warnings is not None:
            entries["warnings"] = [w if isinstance(w, str) else w.to_dict() for w in self.warnings]
        return _join(entries, self.details, self.layout)

    def with_warnings(self, warnings: Sequence[Mapping[str, Any] | str]) -> RunResult:
        return dataclasses.replace(self, warnings=tuple(ResultWarning.from_dict(w) for w in warnings))


def _plain(value: Any) -> Any:
    """Tuples back to the lists JSON holds; mappings copied."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in value.items()}
    return value
