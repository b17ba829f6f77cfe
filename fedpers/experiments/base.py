"""What every algorithm provides to the runner, the CLI, the sweeps and the Flower apps.

An :class:`Experiment` turns a frozen config into: the public protocol (calibrated,
data-independent), the data of any subset of units (so a Flower node can load only its
own), an evaluator for per-round and final metrics, and the privacy summary.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from fedpers import config as config_lib
from fedpers.config import RunConfig
from fedpers.data.units import UnitSource
from fedpers.experiments.hooks import CanaryDesign, PrivateScore
from fedpers.privacy import Calibrations, Ledger
from fedpers.protocols.base import Protocol, State, Units
from fedpers.results.quantities import Quantity
from fedpers.seeds import derived_seed  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from fedpers.runtime.local import Companion

Tensor = torch.Tensor
ConfigT = TypeVar("ConfigT", bound=RunConfig)
"""An experiment's config type: a :class:`~fedpers.config.RunConfig` (seed, ε, chunk size, device)."""
ProtocolT = TypeVar("ProtocolT", bound=Protocol)
"""The protocol an experiment's config builds."""


class Evaluator(abc.ABC):
    """Measures a run against the truth the simulator knows (the runtime never sees it)."""

    def round_metrics(self, round: int, state: State) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Tensor]:
        """What the evaluator kept from earlier rounds (e.g. round 0's private U for a baseline);
        a run directory keeps it so a resumed run evaluates as the uninterrupted one."""
        return {}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore :meth:`state_dict` (a resumed run)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state between rounds; got {sorted(state)}")

    @abc.abstractmethod
    def final(self, state: State) -> dict[str, Any]:
        """Final metrics (and baselines) for the final server state."""

    def final_phase(self) -> str:
        """What :meth:`final` computes, as the progress line announcing it names it."""
        return "the private result and its baselines"

    def companions(self) -> Sequence[Companion]:
        """Baselines that read the users in the private run's own passes (the local runtime calls
        them chunk by chunk; see :class:`~fedpers.runtime.local.Companion`); :meth:`final` computes
        whatever they did not complete on its own. Default: none."""
        return ()

    def reuse_baselines(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        """Take ``rows`` (name → the row :meth:`final` reports under ``baselines``) of some of the
        run's :meth:`Experiment.shared_baselines` as computed by another run with the same
        :meth:`Experiment.baseline_key`: :meth:`final` reports them as given and computes only the others."""
        if rows:
            raise ValueError(f"{type(self).__name__} shares no baselines; got {sorted(rows)}")


@dataclass(frozen=True)
class Trivial:
    """A baseline a private run must beat to be worth reporting: the run's ``metric`` against the
    same metric of ``baseline`` (a name in ``result["baselines"]``)."""

    metric: str
    baseline: str
    higher_is_better: bool = False
    why: str = ""
    """What usually causes a loss to this baseline, and the flags that change it."""


def trivial_value(result: Mapping[str, Any], t: Trivial) -> float | None:
    """The baseline's value of ``t.metric`` in ``result`` (None: not measured in this run)."""
    row = result.get("baselines", {}).get(t.baseline)
    value = row.get(t.metric) if isinstance(row, Mapping) else None
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def check_trivial(trivial: list[Trivial], result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One warning per trivial baseline the private result does not beat (ties lose: a private
    run that only matches a trivial predictor has bought nothing with its privacy budget)."""
    warnings = []
    for t in trivial:
        base, value = trivial_value(result, t), result.get(t.metric)
        if base is None or not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            continue  # not measured, or NaN/inf: non_finite_warnings names that
        value = float(value)
        beats = value > base if t.higher_is_better else value < base
        if not beats:
            warnings.append(
                {
                    "metric": t.metric,
                    "private": value,
                    "baseline": t.baseline,
                    "baseline_value": base,
                    "text": f"the private {t.metric} ({value:.4g}) is {'no better than' if value == base else 'worse than'} "
                    f"the trivial baseline {t.baseline} ({base:.4g})" + (f": {t.why}" if t.why else ""),
                }
            )
    return warnings


def _higher_is_better(metric: str) -> bool:
    return "accuracy" in metric


def every_shared_metric(trivial: list[Trivial], metrics: tuple[str, ...], result: Mapping[str, Any]) -> list[Trivial]:
    """``trivial`` plus, for each of its baselines reported under ``result["baselines"]``, every other
    metric of ``metrics`` the run and that baseline both report (same direction as a declared one)."""
    out = list(trivial)
    listed = {(t.metric, t.baseline) for t in trivial}
    direction = {t.metric: t.higher_is_better for t in trivial}
    for t in trivial:
        row = result.get("baselines", {}).get(t.baseline)
        if not isinstance(row, Mapping):
            continue
        for metric in metrics:
            if metric in row and metric in result and (metric, t.baseline) not in listed:
                listed.add((metric, t.baseline))
                higher = direction.get(metric, _higher_is_better(metric))
                out.append(Trivial(metric, t.baseline, higher, t.why))
    return out


def non_finite_warnings(
    metrics: tuple[str, ...], result: Mapping[str, Any], cause: Callable[[str], str]
) -> list[dict[str, Any]]:
    """One warning per metric of ``metrics`` the result reports as NaN or ±inf, naming its cause."""
    out = []
    for metric in metrics:
        value = result.get(metric)
        if isinstance(value, float) and not math.isfinite(value):
            out.append({"metric": metric, "private": value, "text": f"{metric} is {value}: {cause(metric)}"})
    return out


def outlier_warnings(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A warning when the data summary counts labels beyond their robust range: the private run
    clips them, but the non-private baselines fit them as they are (one label of 1e9 made
    local_only's test MSE 1e14 without a word)."""
    data = result.get("data")
    count = data.get("labels_beyond_robust_range") if isinstance(data, Mapping) else None
    if not isinstance(count, int) or count <= 0:
        return []
    assert isinstance(data, Mapping)
    lo, hi = data.get("label_robust_range", ["?", "?"])
    return [
        {
            "metric": "labels",
            "count": count,
            "text": f"{count} label(s) lie beyond the robust range [{lo}, {hi}] (quartiles ± 10 interquartile "
            "ranges of the kept labels): the private run clips every label at its declared bound, but the "
            "non-private baselines fit them unclipped, so their figures may be dominated by them; check the file",
        }
    ]


def strategy_warnings(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A warning when the run's correlated-noise strategy is worse than independent noise on its own
    loss (a strategy it was given, e.g. ``--noise banded`` with more bands than help): never silent."""
    privacy = result.get("privacy")
    text = privacy.get("strategy_warning") if isinstance(privacy, Mapping) else None
    return [{"metric": "noise", "text": text}] if isinstance(text, str) and text else []


class Experiment(abc.ABC, Generic[ConfigT, ProtocolT]):
    """One algorithm: its config type ``ConfigT`` and the protocol type ``ProtocolT`` it builds
    (``class AltMinExperiment(Experiment[AltMinConfig, AltMinProtocol])``); every hook takes the
    config and the protocol typed as such."""

    name: str
    config_type: type[ConfigT]
    primary_metric: str = "excess_risk"
    round_axis: str = "round"
    """The x label of per-round plots (what a round is for this algorithm)."""
    result_keys: tuple[str, ...] = ()
    """Every metric ``Evaluator.final`` may return at the top level of the result (which ones
    a run has can depend on its config and data): a sweep checks its metrics against these
    before any point runs."""
    baseline_names: tuple[str, ...] = ()
    """Every baseline ``final`` may report under ``baselines`` (each with ``result_keys``)."""
    privacy_fields: tuple[str, ...] = ()
    """Config fields that change only the private run (ε, δ, the accountant, the neighbouring
    relation, how the noise is calibrated), never a baseline of :meth:`Evaluator.shared_baselines`. Empty: the experiment shares
    no baselines between runs (:meth:`baseline_key`)."""
    quantities: ClassVar[Mapping[str, Quantity]] = {}
    """What each of its figures is, in words, where this algorithm's meaning is its own or the figure is
    not one of :data:`fedpers.results.quantities.SHARED`: every view labels, places and defines a
    figure by it (a metric column, a bound row, a detail)."""

    @abc.abstractmethod
    def protocol(self, cfg: ConfigT, calibrations: Calibrations | None = None) -> ProtocolT:
        """The public protocol for ``cfg`` with noise calibrated to its (ε, δ); ``calibrations``
        holds (and records) the noise multipliers solved for (a Flower server sends its table so
        nodes rebuild the protocol without the accountant)."""

    @abc.abstractmethod
    def num_units(self, cfg: ConfigT) -> int: ...

    @abc.abstractmethod
    def units(self, cfg: ConfigT, ids: Tensor) -> Units:
        """Data of the units with these global ids (what a client holds)."""

    def chunk_size(self, cfg: ConfigT) -> int:
        """Units per batch on the local runtime."""
        return cfg.chunk_size

    def unit_source(self, cfg: ConfigT) -> UnitSource:
        """Every unit for the local runtime: here held in memory (loaded once for all rounds);
        an experiment whose units are cheap to regenerate streams them chunk by chunk instead."""
        return UnitSource.of(self.units(cfg, torch.arange(self.num_units(cfg))))

    @abc.abstractmethod
    def evaluator(self, cfg: ConfigT, protocol: ProtocolT) -> Evaluator: ...

    @abc.abstractmethod
    def privacy_summary(self, cfg: ConfigT, protocol: ProtocolT, ledger: Ledger) -> dict[str, Any]:
        """ε from the accountant over the ledger, the noise, and the paper's own calibration."""

    def plot_keys(self) -> tuple[str, ...]:
        """Per-round metrics worth a PNG."""
        return ()

    def describe(self, cfg: ConfigT, protocol: ProtocolT) -> Mapping[str, Any]:
        """Derived constants worth writing into the run directory."""
        return {}

    def trivial_baselines(self, cfg: ConfigT) -> list[Trivial]:
        """The trivial predictors this run must beat (global mean, local-only, private init,
        chance...), each with what to change when it does not; see :func:`check_trivial`."""
        return []

    def result_warnings(self, cfg: ConfigT, result: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Warnings written into ``result.json`` (``warnings``) and printed loudly by the CLI: a
        metric that is NaN or infinite (with its cause), and every metric of the run no better than
        the same metric of a trivial baseline (the declared ones, and every other metric those
        baselines report: real data has test_mse where synthetic data has excess_risk)."""
        found = non_finite_warnings(self.result_keys, result, lambda m: self.non_finite_cause(cfg, result, m))
        found += outlier_warnings(result) + strategy_warnings(result)
        return found + check_trivial(every_shared_metric(self.trivial_baselines(cfg), self.result_keys, result), result)

    def non_finite_cause(self, cfg: ConfigT, result: Mapping[str, Any], metric: str) -> str:
        """Why ``metric`` came out NaN or infinite (an algorithm names its known causes)."""
        return (
            "no data to measure it on (check the data summary: a test split with no rows gives NaN) "
            "or the model diverged (lower the step size, raise --epsilon)"
        )

    def plan(self, cfg: ConfigT) -> list[str]:
        """Lines the CLI prints before the run starts (sizes, memory). Raise ``ValueError`` to
        refuse a run that cannot fit, naming what it needs; :meth:`protocol` must refuse it too."""
        return []

    def shared_baselines(self, cfg: ConfigT) -> tuple[str, ...]:
        """The baselines of a run of ``cfg`` whose rows depend on the data, the seed and their own
        parameters alone, never on :attr:`privacy_fields`: a sweep computes them once per
        :meth:`baseline_key` and hands them to its other points (:meth:`Evaluator.reuse_baselines`).
        Default: none."""
        return ()

    def shared_rows(self, cfg: ConfigT, result: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
        """The rows of :meth:`shared_baselines` in a finished run's ``result`` (what
        :meth:`Evaluator.reuse_baselines` takes back), or None when it lacks one (a baseline that
        failed: the next run computes it). Default: the rows under ``result["baselines"]``."""
        names, rows = self.shared_baselines(cfg), result.get("baselines", {})
        if not names or result.get("baselines_error") or any(n not in rows for n in names):
            return None
        return {n: dict(rows[n]) for n in names}

    def baseline_key(self, cfg: ConfigT) -> dict[str, Any] | None:
        """What ``cfg``'s shared baselines (:meth:`Evaluator.shared_baselines`) depend on: the algorithm
        and every config field but :attr:`privacy_fields` (the data, the seed, each baseline's own
        parameters, and whatever else is not known to be privacy-only). Two configs with equal keys
        have the same shared baselines; None: the experiment shares none."""
        if not self.privacy_fields:
            return None
        values = config_lib.to_dict(cfg)
        key = {"algorithm": self.name, **{k: v for k, v in values.items() if k not in self.privacy_fields}}
        for name in values:  # a data file stands for its contents: a changed file is another key
            path = getattr(cfg, name)
            if isinstance(path, Path) and path.is_file():
                stat = path.stat()
                key[f"{name}:file"] = {"bytes": stat.st_size, "modified_ns": stat.st_mtime_ns}
        return key

    # ----- optional hooks: each default means "not supported by this algorithm" -----
    def canary_design(self) -> CanaryDesign | None:
        """How ``fedpers audit`` builds canaries for this algorithm (None: the audit refuses it)."""
        return None

    def private_scores(self) -> dict[str, PrivateScore]:
        """The private validation scores ``fedpers sweep --select METRIC --private`` may select by,
        keyed by METRIC (empty: no private selection for this algorithm)."""
        return {}

    def reduced_config(self) -> dict[str, Any]:
        """Config values of a small run the test suite runs quickly (seconds) with the defaults
        otherwise unchanged (empty: the defaults are already small)."""
        return {}
