"""`fedpers audit ALGO`: an empirical lower bound on a run's ε, from canary users scored on its releases.

K canary users, each holding one of two data sets (a "+" and a "−" version: a replace-one
neighbour pair) chosen by a fair coin the auditor keeps, make up the population of a run of
the real protocol through the real server path (:func:`fedpers.runtime.driver.drive`, the
local runtime's round loop) and the real :class:`~fedpers.privacy.Privatizer`. What the
server published — every round's broadcast and every release's noisy value with its
ledger record — is all the scorer receives (:class:`Published`): never a summed statistic
before noise. For each canary and release the scorer computes, from the broadcast and the
canary's two candidate data sets, what the canary adds to the sum under each version, and
scores the log-likelihood ratio of "+" against "−" (the Neyman–Pearson test for a Gaussian
release). Guesses from the scores give three lower bounds (:mod:`fedpers.audit.bounds`):

- ``epsilon_lower``: ε at δ, valid for any mechanism, one run (Steinke, Nasr & Jagielski 2023);
- ``one_run_gdp``: μ (then ε at δ) that the guesses reject for a μ-GDP claim, one run
  (Mahloujifar, Melis & Chaudhuri 2024);
- ``independent_gdp``: μ from Clopper–Pearson bounds on TPR/FPR with the canaries as
  independent trials (exact across runs; within a run, under the ledger's own claim).

Canaries are the strongest the protocol allows: every statistic a canary sends sits at its
clip bound, each canary along its own coordinate so the scores do not interfere. The audit
tests the replace-one user relation the accountant proves (the two versions are the same
user with different data). See docs/audit.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from fedpers.audit import bounds as audit_math
from fedpers.audit.canaries import PLACEMENTS, audited_algorithms, bound_steer, paired_canaries, steered_units
from fedpers.audit.published import (
    Published,
    PublishingPrivatizer,
    node_side_plan,
    run_published,
    run_published_flower,
    run_published_nodes,
)
from fedpers.audit.scores import (
    NULL_SCORE_ASSUMPTION,
    NULL_SLOTS_PER_RUN,
    CanaryScores,
    canary_scores,
    gdp_epsilon,
    in_role_scores,
    null_scores,
    null_slot_bound,
    present_only,
    proven_mu,
    skellam_gaussian_mu,
    with_null_slots,
)
from fedpers.config import DpModel, Neighbours
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.base import Experiment, derived_seed
from fedpers.experiments.hooks import Canaries, CanaryDesign
from fedpers.privacy import Ledger, Release, ledger_epsilon
from fedpers.privacy import accountant as accountant_lib
from fedpers.protocols.base import Protocol

Tensor = torch.Tensor


DEFAULT_CANARIES = 10
"""Canaries per run when none are asked for: this many, or the design's orthogonal capacity if that
is smaller (at least 2)."""


def default_canaries(design: CanaryDesign, cfg: Any, placement: str) -> int:
    """:data:`DEFAULT_CANARIES`, or fewer where the design has fewer orthogonal directions for ``cfg``
    (a design without random placement cannot go beyond them)."""
    capacity = design.capacity(design.protocol(cfg, 2)) // (2 if placement == "paired" else 1)
    return max(2, min(DEFAULT_CANARIES, capacity))


def audit(
    exp: Experiment,
    cfg: Any,
    canaries: int | None = None,
    runs: int = 1,
    confidence: float = 0.95,
    seed: int = 0,
    privatizer_factory: Callable[[int], PublishingPrivatizer] = PublishingPrivatizer,
    placement: str = "auto",
    releases: tuple[str, ...] | None = None,
    null_slots: bool = True,
    flower: Any = None,
    grid: Any = None,
    node_side: RuntimeOptions | None = None,
) -> dict[str, Any]:
    """``runs`` independent runs of ``exp`` on ``canaries`` canaries each (None: :func:`default_canaries`);
    lower bounds beside the proven ε.

    ``placement``: ``orthogonal`` (one coordinate each, at most the design's capacity), ``random``
    (random directions, any number, where the design offers them) or ``auto`` (orthogonal up to
    the capacity, random beyond) or ``paired`` (:func:`paired_canaries`: half the capacity; reaches
    a PSD release's full sensitivity). ``releases``: audit only the releases of these statistic names
    (e.g. AltMin's ``W`` and ``b``) against the proven ε/μ of those releases alone — a tight audit
    of that sub-composition, not of the whole run (see docs/audit.md). ``null_slots``: with orthogonal
    placements, score the design's unused capacity as empty slots (up to :data:`NULL_SLOTS_PER_RUN`
    per run) for the null-slot Gaussian-score bound (:func:`in_role_scores`, :func:`null_scores`).
    ``flower``: runtime options (``runtime = flower``) to run every audit run through the Flower
    runtime's server loop and ClientApp (:func:`run_published_flower`; a simulation on Ray, or
    the Grid that ``grid(client_app, nodes)`` makes) instead of the local runtime. ``node_side``:
    runtime options whose ``dp_model`` is distributed or local — the nodes add the noise, simulated
    exactly on the local runtime (:func:`node_side_plan`, :func:`run_published_nodes`)."""
    design = exp.canary_design()
    if design is None:
        raise ValueError(f"algorithm: the audit has canaries for {', '.join(audited_algorithms())}; got {exp.name}")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence}")
    if math.isinf(cfg.epsilon):
        raise ValueError("epsilon must be finite: a run without noise has no guarantee to audit")
    if getattr(cfg, "neighbours", Neighbours.REPLACE_ONE) is not Neighbours.REPLACE_ONE:
        raise ValueError(
            "neighbours must be replace-one for the canary audit (a canary's two versions are a replace-one pair); "
            f"got {cfg.neighbours.value}"
        )
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    if placement == "steered" and design.steer is None:
        raise ValueError(f"placement: {exp.name}'s canary design has no steered placement")
    if placement == "random" and design.random_canaries is None:
        raise ValueError(f"placement: {exp.name}'s canary design has no random placement; use orthogonal")
    if canaries is None:
        canaries = default_canaries(design, cfg, placement)
    if node_side is not None and node_side.dp_model is DpModel.CENTRAL:
        node_side = None
    if node_side is not None and flower is not None:
        raise ValueError(
            f"dp_model {node_side.dp_model.value}: the audit simulates the nodes on the local runtime; drop --runtime flower"
        )
    if node_side is not None and placement == "steered":
        raise ValueError(f"placement: steered canaries are not offered under dp_model {node_side.dp_model.value}")
    if node_side is not None:
        protocol, node_options, privatizer_factory = node_side_plan(design, cfg, canaries, node_side)
    else:
        protocol = design.protocol(cfg, canaries)
    only = _release_names(protocol, releases)
    capacity = design.capacity(protocol) // (2 if placement == "paired" else 1)
    random = placement == "random" or (placement == "auto" and canaries > capacity)
    if random and design.random_canaries is None:
        raise ValueError(
            f"canaries must be in [2, {capacity}] for {exp.name} with these flags (one orthogonal direction each; "
            f"its design has no random placement); got {canaries} with placement {placement}"
        )
    if canaries < 2 or (not random and canaries > capacity):
        raise ValueError(
            f"canaries must be in [2, {capacity}] for {exp.name} with these flags (one orthogonal direction each); got {canaries}"
        )
    delta = float(cfg.delta)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # K tiny users: one thread is several times faster than a contended pool
    try:
        return _audit_runs(
            exp,
            cfg,
            design,
            protocol,
            canaries,
            runs,
            confidence,
            seed,
            delta,
            privatizer_factory,
            random,
            only,
            placement,
            0 if random or not null_slots else min(capacity - canaries, NULL_SLOTS_PER_RUN),
            (lambda run, units, privatizer, steered: run_published_nodes(protocol, units, privatizer))
            if node_side is not None
            else None
            if flower is None
            else (
                lambda run, units, privatizer, steered: run_published_flower(
                    exp,
                    cfg,
                    protocol,
                    units,
                    privatizer,
                    flower,
                    derived_seed(seed, f"audit-flower-{run}"),
                    grid,
                    steered,
                )
            ),
            None if node_side is None else node_options,
        )
    finally:
        torch.set_num_threads(threads)


def _audit_runs(
    exp: Experiment,
    cfg: Any,
    design: CanaryDesign,
    protocol: Protocol,
    canaries: int,
    runs: int,
    confidence: float,
    seed: int,
    delta: float,
    privatizer_factory: Callable[[int], PublishingPrivatizer],
    random: bool = False,
    only: frozenset[str] | None = None,
    placement: str = "orthogonal",
    spare: int = 0,
    through: Callable[
        [
            int,
            Mapping[str, Tensor],
            PublishingPrivatizer,
            Callable[[int, Mapping[str, Tensor]], Mapping[str, Tensor]] | None,
        ],
        tuple[Published, Ledger],
    ]
    | None = None,
    node_options: RuntimeOptions | None = None,
) -> dict[str, Any]:
    paired = placement == "paired"
    make = design.random_canaries if random and design.random_canaries is not None else design.canaries
    if paired:
        orthogonal, pair = make, design.paired_canaries or paired_canaries

        def make(protocol: Any, generator: torch.Generator, count: int) -> Canaries:
            return pair(orthogonal(protocol, generator, 2 * count))

    coins = torch.Generator().manual_seed(derived_seed(seed, "audit-coins"))
    data = torch.Generator().manual_seed(derived_seed(seed, "audit-canaries"))
    scores, standards, seps, truth, in_role, nulls = [], [], [], [], [], []
    ledger = Ledger()
    start = time.perf_counter()
    for run in range(runs):
        slots = with_null_slots(make(protocol, data, canaries + spare), canaries)
        cans = present_only(slots, canaries)
        included = torch.rand(canaries, generator=coins) < 0.5
        privatizer = privatizer_factory(derived_seed(seed, f"audit-noise-{run}"))
        steer = bound_steer(design, protocol, slots) if placement == "steered" else None
        steered = None if steer is None else steered_units(steer, included, canaries)
        if through is not None:
            published, ledger = through(run, cans.units(included), privatizer, steered)
        else:
            published, ledger = run_published(protocol, cans.units(included), privatizer, steered)
        every = canary_scores(protocol, published, slots, only, steer, present=canaries)
        scored = CanaryScores(every.llr[:canaries], every.gram[:canaries, :canaries])
        scores.append(scored.llr)
        standards.append(scored.standard)
        seps.append(scored.separation)
        truth.append(included)
        if spare:
            try:
                nulls.append(null_scores(every, canaries))
                in_role.append(in_role_scores(scored, included))
            except ValueError:  # the design's slots share a coordinate (e.g. a total entry): no null-slot bound
                spare, in_role, nulls = 0, [], []
    llr, standard, sep, included = torch.cat(scores), torch.cat(standards), torch.cat(seps), torch.cat(truth)
    accountant = getattr(cfg, "accountant", accountant_lib.Accountant.PLD)
    whole = ledger
    if only is not None:  # the proven values of the audited releases alone: what this audit can reach
        names = _release_names_of(protocol, published, only)
        ledger = Ledger([r for r in whole if r.name in names])
    proven = ledger_epsilon(ledger, delta, accountant)
    mu_proven = proven_mu(ledger)
    snj = audit_math.one_run_lower_bound(llr, included, delta, confidence)
    gdp_one = audit_math.one_run_gdp_lower_bound(llr, included, delta, confidence)
    mu_ind = audit_math.independent_gdp_lower_bound(standard, included, confidence)
    sides = min(int(included.sum()), int((~included).sum()))
    gauss = audit_math.gaussian_score_mu(standard, included, confidence) if sides >= 2 else None
    gauss_null = null_slot_bound(torch.cat(in_role), torch.cat(nulls), confidence) if spare else None
    return {
        "algorithm": exp.name,
        "neighbouring": design.neighbouring,
        "releases_tested": design.releases,
        "canary_design": cans.design,
        "canaries_per_run": canaries,
        "runs": runs,
        "confidence": confidence,
        "delta": delta,
        "proven_epsilon": proven,
        "proven_mu": mu_proven,
        "canary_mu": float(sep.mean()),
        "epsilon_lower": snj["epsilon_lower"],
        "one_run": snj,
        "one_run_gdp": gdp_one,
        "independent_gdp": {
            "mu_lower": mu_ind,
            "epsilon_lower": accountant_lib.analytic_gaussian_epsilon(mu_ind, delta) if mu_ind > 0 else 0.0,
        },
        "gaussian_score": None
        if gauss is None
        else {
            **gauss,
            "epsilon": gdp_epsilon(gauss["mu"], delta),
            "epsilon_lower": gdp_epsilon(gauss["mu_lower"], delta),
            "assumption": audit_math.GAUSSIAN_SCORE_ASSUMPTION,
        },
        "gaussian_score_null": None
        if gauss_null is None
        else {
            **gauss_null,
            "epsilon": gdp_epsilon(gauss_null["mu"], delta),
            "epsilon_lower": gdp_epsilon(gauss_null["mu_lower"], delta),
            "assumption": NULL_SCORE_ASSUMPTION,
        },
        "placement": "random directions (interference in the scores)"
        if random
        else ("orthogonal pairs (the same data on either coordinate)" if paired else "orthogonal")
        + ("; steered: every round's data rebuilt from its broadcast (white-box)" if placement == "steered" else ""),
        "audited_releases": "all" if only is None else sorted(only),
        "run_proven_epsilon": proven if only is None else ledger_epsilon(whole, delta, accountant),
        "run_proven_mu": mu_proven if only is None else proven_mu(whole),
        "runtime": "local" if through is None or node_options is not None else "flower",
        "dp_model": "central" if node_options is None else node_options.dp_model.value,
        "nodes": None if node_options is None else _node_summary(node_options, privatizer),
        "skellam_gaussian_mu": skellam_gaussian_mu(ledger),
        "trials": runs * canaries,
        "seconds": time.perf_counter() - start,
        "noise_multiplier": float(getattr(protocol, "noise_multiplier", float("nan"))),
    }


def _node_summary(options: RuntimeOptions, privatizer: Any) -> dict[str, Any]:
    plan = getattr(privatizer, "plan", None)
    out: dict[str, Any] = {"nodes": options.nodes, "min_nodes": options.min_nodes or options.nodes}
    if plan is not None:
        out["bits"] = plan.bits
        out["noise_multiplier"] = plan.noise_multiplier
    return out


def _release_names_of(protocol: Protocol, published: Published, only: frozenset[str]) -> set[str]:
    """The ledger names of the published releases of the statistics ``only`` names (a release's
    ledger name, e.g. ``dpals.item_sums``, need not be its statistic's, ``s``)."""
    names: set[str] = set()
    by_round: dict[int, list[Release]] = {}
    for release, _ in published.releases:
        by_round.setdefault(release.round, []).append(release)
    for r, released in by_round.items():
        names |= {rel.name for spec, rel in zip(protocol.stat_specs(r), released) if spec.name in only}
    return names


def _release_names(protocol: Protocol, releases: tuple[str, ...] | None) -> frozenset[str] | None:
    """The statistic names to audit, checked against every name the protocol releases (None: all)."""
    if releases is None:
        return None
    known: list[str] = []
    for r in range(protocol.num_rounds + 1):
        known += [s.name for s in protocol.stat_specs(r) if s.name not in known]
    unknown = [n for n in releases if n not in known]
    if not releases or unknown:
        raise ValueError(
            f"releases must be a non-empty subset of {', '.join(known)}; got {', '.join(releases) or 'none'}"
        )
    return frozenset(releases)


def audit_configuration(
    run_dir: str | Path,
    canaries: int | None = None,
    runs: int = 1,
    confidence: float = 0.95,
    seed: int = 0,
    placement: str = "auto",
    releases: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Audit the configuration a finished run used (its canaries replace the population; everything
    else as configured, its trust model included, on the local runtime)."""
    import json

    from fedpers import config as config_lib
    from fedpers.experiments import ALGORITHMS, experiment

    path = Path(run_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"audit: {path} is not a fedpers run directory (no config.json)")
    saved = json.loads((path / "config.json").read_text())
    name = saved.pop("algorithm", None)
    if name not in ALGORITHMS:
        raise ValueError(f"audit: {path}/config.json names algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    options = config_lib.build(RuntimeOptions, saved.pop("runtime", None) or {})
    exp = experiment(name)
    cfg = config_lib.build(exp.config_type, saved)
    return audit(
        exp,
        cfg,
        canaries,
        runs=runs,
        confidence=confidence,
        seed=seed,
        placement=placement,
        releases=releases,
        node_side=options,  # the run's trust model: distributed or local DP is audited as the nodes ran it
    )
