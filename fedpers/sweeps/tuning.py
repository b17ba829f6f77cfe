"""Choosing hyper-parameters from a sweep: privately (charged to ε) or not (and said so).

``fedpers sweep FILE --select METRIC --private`` runs Papernot & Steinke's (2022) private
selection over the sweep's grid points: draw K ~ TNB(η, γ) (a truncated negative binomial
with the requested mean; η = 1, the geometric law, by default), run K trials, each on a
grid point drawn uniformly, and release only the best trial's choice. Each trial is a real
private run of the candidate (its own Privatizer and ledger) followed by a private score: a
per-user validation statistic of held-out users (users the training never touches), clipped
to a public range, summed, and released through ``Privatizer.gaussian_sum`` into the same
ledger. The whole search is dp-accounting's ``RepeatAndSelectDpEvent(trial, mean, η)``; the
chosen point is then run once more (the final run, written as a normal run directory), and
the ε reported is RDP's for the composition of both, beside the final run's own ε (what a
naive report would claim).

Why Papernot–Steinke rather than Liu & Talwar 2019: our trials are Gaussian mechanisms,
accounted in RDP/PLD, and Liu–Talwar's theorem is stated for pure ε-DP trials (ε → 3ε);
Papernot–Steinke give RDP bounds for any RDP trial, contain Liu–Talwar's geometric stopping
rule as η = 1, and dp-accounting implements them (so the accounting is the library's).

``fedpers sweep FILE --select METRIC`` without ``--private`` picks the best grid point by the
sweep table's (non-private) metric and says that the choice is not accounted.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dp_accounting
import torch
from dp_accounting.dp_event import RepeatAndSelectDpEvent
from dp_accounting.rdp import rdp_privacy_accountant

from fedpers import config as config_lib
from fedpers.config import Neighbours
from fedpers.experiments.base import Experiment, derived_seed
from fedpers.experiments.hooks import PrivateScore
from fedpers.privacy import (
    ALL_UNITS,
    Ledger,
    Privatizer,
    event_epsilon,
    selection,
)

Tensor = torch.Tensor
DEFAULT_SHAPE = 1.0


class Goal(str, enum.Enum):
    MIN = "min"
    MAX = "max"


# ----- non-private selection -----------------------------------------------------------------
def select_nonprivate(sweep_dir: Path, metric: str, goal: Goal) -> dict[str, Any]:
    """The grid point with the best mean ``metric`` over its repetitions, from the sweep's point
    records. The choice read non-private metrics: it is not accounted."""
    points = []
    spec_file = Path(sweep_dir) / "spec.json"
    references = set(json.loads(spec_file.read_text()).get("references", {})) if spec_file.exists() else set()
    for record in sorted((Path(sweep_dir) / "points").glob("[0-9]*.json")):
        data = json.loads(record.read_text())
        if data.get("label") in references:  # a reference line is not a candidate
            continue
        values = [
            r[metric] for r in data["rows"] if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])
        ]
        if values:
            points.append((sum(values) / len(values), data["overrides"]))
    if not points:
        raise ValueError(f"select: no grid point reported a finite {metric!r}; list it under the sweep's metrics")
    best = (min if goal is Goal.MIN else max)(points, key=lambda p: p[0])
    return {
        "selected": best[1],
        metric: best[0],
        "private": False,
        "note": "chosen by the non-private sweep metric: the choice is NOT accounted (its ε is not reported)",
    }


# ----- private scores (each algorithm's own: ``Experiment.private_scores``) -----------------------
def private_score(
    exp: Experiment,
    cfg: Any,
    protocol: Any,
    state: Any,
    privatizer: Privatizer,
    score: PrivateScore,
    validation_users: int,
    round: int,
) -> float:
    """The mean clipped validation statistic of ``validation_users`` held-out users (ids n, n+1, …),
    released as a Gaussian sum: each user adds clip(s_j; [0, c]) − c/2, so the per-user bound is
    c/2 (Δ = c), with the candidate's own noise multiplier."""
    c = score.clip(cfg)
    ids = torch.arange(exp.num_units(cfg), exp.num_units(cfg) + validation_users)
    per_user = score.per_user(cfg, protocol, state, score.units(cfg, ids)).clamp(0.0, c)
    per_user = torch.where(torch.isfinite(per_user), per_user, torch.full_like(per_user, c))
    noisy = privatizer.gaussian_sum(
        (per_user - c / 2).sum().reshape(1),
        per_unit_bound=c / 2,
        noise_multiplier=protocol.noise_multiplier,
        name=f"tuning.{score.metric}",
        round=round,
        units=ALL_UNITS,
        params={
            "statistic": score.metric,
            "clip": c,
            "validation_users": validation_users,
            "formula": "clip(s_j; [0, c]) − c/2, bound c/2",
        },
    )
    return float(noisy[0]) / validation_users + c / 2


# ----- accounting ------------------------------------------------------------------------------
def worst_event(ledger: Ledger, delta: float) -> dp_accounting.DpEvent:
    """The composed event of the ledger's worst-placed unit group (the one ``ledger_epsilon`` reports)."""
    groups: list[str | None] = [*ledger.groups()] or [None]
    events = [
        dp_accounting.ComposedDpEvent([r.event for r in (ledger.touching(g) if g is not None else list(ledger))])
        for g in groups
    ]
    return max(events, key=lambda e: event_epsilon(e, delta))


def add_remove_event(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """A replace-one event as the add/remove event with the same privacy loss, for dp-accounting's
    RDP accountant (which reads Gaussians as add/remove): noise multiplier z → z/2."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return dp_accounting.GaussianDpEvent(event.noise_multiplier / 2)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return dp_accounting.ComposedDpEvent([add_remove_event(e) for e in event.events])
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return dp_accounting.SelfComposedDpEvent(add_remove_event(event.event), event.count)
    if isinstance(event, RepeatAndSelectDpEvent):
        return RepeatAndSelectDpEvent(add_remove_event(event.event), event.mean, event.shape)
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return event
    raise ValueError(
        f"select --private: trials must be unsampled Gaussian releases (RDP, replace-one); got {type(event).__name__}"
    )


def tuning_event(
    trial_events: list[dp_accounting.DpEvent], final_event: dp_accounting.DpEvent | None, mean: float, shape: float
) -> dp_accounting.DpEvent:
    """RepeatAndSelect over the trial mechanism, composed with the final run.

    A trial draws a candidate uniformly; its RDP is at most the largest candidate's (Rényi
    divergence is jointly quasi-convex), which the composition of the distinct candidates'
    events bounds (RDP adds, and each term is ≥ 0); with one distinct event it is exact.
    """
    distinct = list({repr(e): e for e in trial_events}.values())
    trial = distinct[0] if len(distinct) == 1 else dp_accounting.ComposedDpEvent(distinct)
    parts: list[dp_accounting.DpEvent] = [RepeatAndSelectDpEvent(trial, float(mean), float(shape))]
    if final_event is not None:
        parts.append(final_event)
    return dp_accounting.ComposedDpEvent(parts)


def rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    """ε at δ of a replace-one event holding a RepeatAndSelectDpEvent (RDP: the only accountant of it)."""
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(add_remove_event(event))
    return float(acc.get_epsilon(delta))


def repeat_and_select(
    generator: torch.Generator,
    candidates: int,
    mean: float,
    shape: float,
    goal: Goal,
    trial: Callable[[int, int], dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """K ~ TNB(shape, mean) trials, each ``trial(t, j)`` on a candidate j drawn uniformly; the one
    with the best ``"score"`` (ties: the earliest). Every draw comes from ``generator`` (the server's)."""
    k = selection.repetitions(generator, mean, shape)
    trials = [trial(t, int(torch.randint(candidates, (), generator=generator))) for t in range(k)]
    best = (min if goal is Goal.MIN else max)(trials, key=lambda r: r["score"])
    return trials, best


# ----- the private search ---------------------------------------------------------------------------
def private_select(
    spec: Any,
    metric: str,
    goal: Goal,
    *,
    mean: float | None = None,
    shape: float = DEFAULT_SHAPE,
    validation_users: int = 2000,
    seed: int = 0,
    out: Path,
    progress: bool = False,
    secure_noise: bool = False,
) -> dict[str, Any]:
    """Papernot–Steinke private selection over ``spec``'s grid points, then a final run of the choice.

    ``secure_noise``: the number of trials, the candidates and all noise (trials and final run) come
    from OS entropy; otherwise from generators seeded by ``seed`` (reproducible, not for deployment:
    the guarantee needs the number of trials secret)."""
    from fedpers.experiments import experiment
    from fedpers.runner import RuntimeOptions, execute
    from fedpers.runtime.local import run_local

    exp = experiment(spec.algorithm)
    scores = exp.private_scores()
    if metric not in scores:
        raise ValueError(
            f"select: with --private, METRIC must be a private score of {spec.algorithm}: {', '.join(scores) or 'none yet'}; got {metric!r}"
        )
    if validation_users < 1:
        raise ValueError(f"validation_users must be >= 1, got {validation_users}")
    score = scores[metric]
    points = spec.grid_points()  # references are comparison lines, not candidates
    configs: list[Any] = [config_lib.build(exp.config_type, {**spec.base, **over}) for _, over in points]
    deltas = {float(c.delta) for c in configs}
    if len(deltas) != 1:
        raise ValueError(
            f"select --private: every grid point must share one delta (the search's δ); got {sorted(deltas)}"
        )
    delta = deltas.pop()
    if any(c.neighbours is not Neighbours.REPLACE_ONE for c in configs):
        raise ValueError(
            "select --private: neighbours must be replace-one (the selection's RDP bound converts replace-one "
            "events; add-remove is not implemented here)"
        )
    if any(math.isinf(c.epsilon) for c in configs):
        raise ValueError(
            "select --private: every grid point needs a finite epsilon (a noiseless trial has no guarantee)"
        )
    mean = float(mean if mean is not None else max(2.0, 2.0 * len(points)))
    if not mean > 1:
        raise ValueError(f"tuning mean must be > 1, got {mean}")
    protocols = [exp.protocol(c) for c in configs]  # calibrated and checked before any release
    tuner = Privatizer(derived_seed(seed, "tuning"), secure=secure_noise)

    def trial(t: int, j: int) -> dict[str, Any]:
        cfg, protocol = configs[j], protocols[j]
        privatizer = Privatizer(derived_seed(seed, f"tuning-trial-{t}"), secure=secure_noise)
        state, _ = run_local(
            protocol, exp.unit_source(cfg), privatizer, chunk_size=exp.chunk_size(cfg), progress=progress
        )
        value = private_score(exp, cfg, protocol, state, privatizer, score, validation_users, protocol.num_rounds)
        return {
            "trial": t,
            "point": j,
            "overrides": points[j][1],
            "score": value,
            "_event": worst_event(privatizer.ledger, delta),
        }

    trials, best = repeat_and_select(tuner.generator, len(points), mean, shape, goal, trial)
    k = len(trials)
    chosen = configs[best["point"]]
    final = execute(exp, chosen, RuntimeOptions(secure_noise=secure_noise), out=Path(out) / "final", progress=progress)
    final_event = worst_event(_ledger_of(final), delta)
    event = tuning_event([r.pop("_event") for r in trials], final_event, mean, shape)
    total = rdp_epsilon(event, delta)
    return {
        "selected": points[best["point"]][1],
        metric: best["score"],
        "metric": metric,
        "goal": goal.value,
        "private": True,
        "method": f"Papernot & Steinke 2022: K ~ truncated negative binomial (η = {shape}, mean {mean:g}), uniform candidates, best released",
        "repetitions": k,
        "noise_source": NOISE_SOURCES[secure_noise],
        "trials": trials,
        "delta": delta,
        "epsilon_total": total,
        "epsilon_naive": float(final["epsilon"]),
        "accounting": "RDP (dp-accounting RepeatAndSelectDpEvent) of the search composed with the final run, replace-one",
        "final_run": final.get("run_dir"),
        "final_metrics": {key: final[key] for key in ("excess_risk", "subspace_error", "test_mse") if key in final},
    }


NOISE_SOURCES = {
    True: "OS entropy (--secure-noise): the number of trials and every draw stay secret",
    False: "seeded generators (--tuning-seed): reproducible, NOT for deployment (anyone with the seed "
    "knows the number of trials and the noise)",
}


def _ledger_of(result: dict[str, Any]) -> Ledger:
    """The final run's ledger, as its run directory recorded it."""
    from fedpers.privacy import Release

    return Ledger([Release.from_dict(d) for d in json.loads((Path(result["run_dir"]) / "ledger.json").read_text())])


def format_selection(result: dict[str, Any], metric: str) -> str:
    if not result["private"]:
        return f"selected {result['selected']} ({metric} = {result[metric]:.4g}); {result['note']}"
    return "\n".join(
        [
            f"selected {result['selected']} (noisy {metric} = {result[metric]:.4g}) after {result['repetitions']} trials",
            f"  {result['method']}",
            f"  ε of tuning + final run = {result['epsilon_total']:.4g} at δ = {result['delta']:.3g} ({result['accounting']})",
            f"  ε a naive report would claim (the final run alone) = {result['epsilon_naive']:.4g}",
            f"  trials, candidates and noise drawn from: {result['noise_source']}",
            *([f"  final run: {result['final_run']}"] if result.get("final_run") else []),
        ]
    )
