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
release). Guesses from the scores give three lower bounds (:mod:`fedpers.privacy.audit`):

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

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
import torch

from fedpers.config import DpModel
from fedpers.configs.runtime import RuntimeOptions
from fedpers.data.units import UnitSource
from fedpers.experiments.base import Experiment, derived_seed
from fedpers.experiments.hooks import Canaries, CanaryDesign
from fedpers.privacy import Ledger, Privatizer, Release, ledger_epsilon
from fedpers.privacy import accountant as accountant_lib
from fedpers.privacy import audit as audit_math
from fedpers.privacy.distributed import (
    DistributedPlan,
    DistributedPrivatizer,
    LocalPrivatizer,
    NodeSidePrivatizer,
    flatten,
)
from fedpers.privacy.ledger import SkellamDpEvent
from fedpers.protocols.base import Protocol, StatSpec, client_message
from fedpers.runtime.driver import ClientReply, drive

Tensor = torch.Tensor


# ----- what the server publishes ----------------------------------------------------------
@dataclass(frozen=True)
class Published:
    """Everything a run made public: the broadcast of every round, and every noisy release with
    its ledger record (σ, bound, round). Nothing else reaches the scorer."""

    broadcasts: tuple[dict[str, Tensor], ...]
    releases: tuple[tuple[Release, Tensor], ...]


class PublishingPrivatizer(Privatizer):
    """A Privatizer that keeps a copy of each value it releases (after noise), as an observer of
    the server's output would see it. The noise itself is the parent's, unchanged."""

    def __init__(self, seed: int, ledger: Ledger | None = None) -> None:
        super().__init__(seed, ledger)
        self.published: list[tuple[Release, Tensor]] = []

    def gaussian_sum(self, value: Tensor, **kwargs: Any) -> Tensor:
        out = super().gaussian_sum(value, **kwargs)
        self.published.append((self.ledger.releases[-1], out.detach().clone()))
        return out

    def symmetric_gaussian_sum(self, value: Tensor, **kwargs: Any) -> Tensor:
        out = super().symmetric_gaussian_sum(value, **kwargs)
        self.published.append((self.ledger.releases[-1], out.detach().clone()))
        return out

    def correlated_gaussian_sum(self, value: Tensor, **kwargs: Any) -> Tensor:
        out = super().correlated_gaussian_sum(value, **kwargs)
        self.published.append((self.ledger.releases[-1], out.detach().clone()))
        return out


PLACEMENTS = ("auto", "orthogonal", "random", "paired", "steered")

Steer = Callable[[int, Mapping[str, Tensor]], Canaries]
"""A round's canaries from that round's broadcast (a design's ``steer`` bound to the run's canaries)."""


def paired_canaries(base: Canaries) -> Canaries:
    """Canary i's "+" version is the "+" data of orthogonal canary 2i, its "−" version the "+" data
    of canary 2i + 1: the same user's data on two orthogonal coordinates (blocks) instead of
    opposite signs on one. A release of a sum of PSD per-user matrices (AltMin's A) then moves by
    its full replace-one sensitivity √2·bound, which a sign flip on one coordinate cannot reach (the
    PSD statistic is sign-blind); sign-sensitive releases move by √2 of their 2·bound."""
    k = base.count // 2
    plus = {key: (torch.arange(k) if key == "ids" else v[0 : 2 * k : 2]) for key, v in base.plus.items()}
    minus = {key: (torch.arange(k) if key == "ids" else v[1 : 2 * k : 2]) for key, v in base.plus.items()}
    return Canaries(
        plus,
        minus,
        f'pairs of orthogonal canaries, the same data on either ("+" as in: {base.design})',
        base.as_released,
    )


def audited_algorithms() -> list[str]:
    """The registered algorithms whose experiment offers a canary design (its ``canary_design`` hook)."""
    from fedpers.experiments import ALGORITHMS, experiment

    return [name for name in ALGORITHMS if experiment(name).canary_design() is not None]


# ----- one run, and the scorer --------------------------------------------------------------
def run_published(
    protocol: Protocol,
    units: Mapping[str, Tensor],
    privatizer: PublishingPrivatizer,
    steered: Callable[[int, Mapping[str, Tensor]], Mapping[str, Tensor]] | None = None,
) -> tuple[Published, Ledger]:
    """Run ``protocol`` on ``units`` through the shared server loop; return only what it published.
    ``steered(round, broadcast)``, when given, is the population's data for that round instead."""
    source = UnitSource.of(units)
    broadcasts: list[dict[str, Tensor]] = []

    def gather(round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        broadcasts.append({k: v.detach().clone() for k, v in broadcast.items()})
        now = source if steered is None else UnitSource.of(steered(round, broadcast))
        message = client_message(protocol, round, broadcast, now.slice(0, now.num_units))
        return [ClientReply("local", source.num_units, message)]

    drive(protocol, gather, privatizer, progress=False)
    return Published(tuple(broadcasts), tuple(privatizer.published)), privatizer.ledger


class _RecordingBroadcasts:
    """``protocol`` for the server loop, keeping a copy of every broadcast it makes (what the server
    publishes each round); everything else is the protocol's own."""

    def __init__(self, protocol: Protocol, into: list[dict[str, Tensor]]) -> None:
        self._protocol, self._into = protocol, into

    def __getattr__(self, name: str) -> Any:
        return getattr(self._protocol, name)

    def broadcast(self, state: Any, round: int) -> Mapping[str, Tensor]:
        out = self._protocol.broadcast(state, round)
        self._into.append({k: v.detach().clone() for k, v in out.items()})
        return out


class _SteeredNode:
    """``protocol`` on a node whose canaries' data are rebuilt every round from that round's broadcast
    (steered placement): ``steered(round, broadcast)`` is the whole population's data for the round,
    and each client update takes the rows of the units it is asked for. Its repr is the protocol's,
    so the node's digest check compares the same public protocol; the server never sees this object."""

    def __init__(
        self, protocol: Protocol, steered: Callable[[int, Mapping[str, Tensor]], Mapping[str, Tensor]]
    ) -> None:
        self._protocol, self._steered = protocol, steered

    def __getattr__(self, name: str) -> Any:
        protocol = self.__dict__.get("_protocol")  # absent while unpickling on a node actor: no recursion
        if protocol is None:
            raise AttributeError(name)
        return getattr(protocol, name)

    def __repr__(self) -> str:
        return repr(self._protocol)

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Mapping[str, Tensor]) -> Any:
        population = self._steered(round, broadcast)
        rows = units["ids"].long().cpu()
        now = {k: v[rows].to(units["ids"].device) for k, v in population.items()}
        return self._protocol.client_update(round, broadcast, now)


def canary_client_app(
    protocol: Protocol,
    units: Mapping[str, Tensor],
    steered: Callable[[int, Mapping[str, Tensor]], Mapping[str, Tensor]] | None = None,
) -> Any:
    """A Flower ClientApp whose nodes hold the audit's canaries: the fedpers node side
    (:func:`fedpers.runtime.flower.client.make_client_app`) with a node builder that returns
    ``protocol`` and serves unit ids from ``units``. It lives in this process and reaches the
    simulation's node actors inside the app object only: a deployed node builds its units from
    its own config and data (:func:`fedpers.app.build_node`) and never holds canaries.
    ``steered``: the canaries' data rebuilt every round from its broadcast (:class:`_SteeredNode`)."""
    from fedpers.runtime.flower.client import Node, make_client_app

    held = {k: v.detach().clone() for k, v in units.items()}
    count = int(held["ids"].shape[0])
    node_protocol: Any = protocol if steered is None else _SteeredNode(protocol, steered)

    def build(job: Any, data_file: str) -> Node:
        if data_file:
            raise ValueError("an audit's canary nodes read no data file")
        return Node(node_protocol, lambda ids: {k: v[ids.to(v.device)] for k, v in held.items()}, num_units=count)

    return make_client_app(build)


def run_published_flower(
    exp: Experiment,
    cfg: Any,
    protocol: Protocol,
    units: Mapping[str, Tensor],
    privatizer: PublishingPrivatizer,
    options: Any,
    nonce: int,
    grid: Any = None,
    steered: Callable[[int, Mapping[str, Tensor]], Mapping[str, Tensor]] | None = None,
) -> tuple[Published, Ledger]:
    """:func:`run_published` through the Flower runtime: the server loop of
    :func:`fedpers.runtime.flower.simulation.run_flower` (in Flower's simulation through its supported
    path, :func:`fedpers.app.simulate_objects`, or on ``grid`` when given: ``grid(client_app, nodes)``
    makes it), the canaries on its nodes (:func:`canary_client_app`). ``nonce`` makes this run's job
    differ from the last one's, so a node process that served an earlier run (it caches its units
    by job) loads this run's canaries."""
    from fedpers.app import flower_job, simulate_objects
    from fedpers.runtime.flower.simulation import run_flower

    broadcasts: list[dict[str, Tensor]] = []
    job = flower_job(exp, dataclasses.replace(cfg, seed=nonce), protocol, calibrations={})
    count = int(units["ids"].shape[0])
    run_options = dataclasses.replace(options, nodes=min(int(options.nodes), count), users_per_node=0)
    server: Any = _RecordingBroadcasts(protocol, broadcasts)
    app = canary_client_app(protocol, units, steered)
    if grid is not None:
        run_flower(job, count, server, privatizer, run_options, progress=False, grid=grid(app, run_options.nodes))
    else:  # Flower's simulation: the server loop runs in its process and sends back what it recorded

        def remote(flower_grid: Any, context: Any) -> tuple[list[dict[str, Tensor]], PublishingPrivatizer]:
            run_flower(job, count, server, privatizer, run_options, progress=False, grid=flower_grid)
            return broadcasts, privatizer

        recorded, drawn = simulate_objects(remote, app, run_options)
        broadcasts[:] = recorded
        privatizer.__dict__.update(drawn.__dict__)
    return Published(tuple(broadcasts), tuple(privatizer.published)), privatizer.ledger


# ----- distributed and local DP: the nodes add the noise ------------------------------------------
NODE_SIDE_MECHANISMS = ("skellam_distributed", "local_gaussian")
"""Ledger mechanisms of releases the nodes noised (:mod:`fedpers.privacy.distributed`)."""


class PublishingDistributedPrivatizer(PublishingPrivatizer, DistributedPrivatizer):
    """Distributed DP's server side, keeping a copy of each decoded sum it releases: the modular sum of
    the nodes' rounded vectors and Skellam shares, centred, un-rotated and un-scaled — all that secure
    aggregation lets the server see. The nodes' noise is theirs, unchanged."""

    def __init__(self, seed: int, plan: DistributedPlan) -> None:
        DistributedPrivatizer.__init__(self, seed, plan)
        self.published = []


class PublishingLocalPrivatizer(PublishingPrivatizer, LocalPrivatizer):
    """Local DP's server side, keeping a copy of each summed release (the audit replaces it by the
    nodes' own noisy vectors, which the server receives in the clear: :func:`run_published_nodes`)."""

    def __init__(self, seed: int, plan: DistributedPlan) -> None:
        LocalPrivatizer.__init__(self, seed, plan)
        self.published = []


def run_published_nodes(
    protocol: Protocol, units: Mapping[str, Tensor], privatizer: PublishingPrivatizer
) -> tuple[Published, Ledger]:
    """:func:`run_published` with the nodes simulated exactly (:func:`fedpers.runtime.distributed.run_local_nodes`:
    each unit's clipped contribution encoded and noised on its node). What is published is what the
    server sees: under distributed DP each release's decoded modular sum; under local DP each node's
    own noisy vector (a (nodes, d) tensor per release, in the statistic's flat form: the upper triangle
    of a symmetric one), the sum of them being post-processing."""
    from fedpers.runtime.distributed import run_local_nodes

    if not isinstance(privatizer, NodeSidePrivatizer):
        raise ValueError("run_published_nodes: the privatizer must be a node-side one (distributed or local DP)")
    broadcasts: list[dict[str, Tensor]] = []
    seen: dict[tuple[int, str], Tensor] = {}
    total = privatizer.plan.nodes

    def observe(round: int, name: str, vectors: Tensor, nodes: Sequence[int]) -> None:
        rows = torch.full((total, vectors.shape[1]), float("nan"), dtype=torch.float64)
        rows[torch.tensor(list(nodes), dtype=torch.long)] = vectors.double()
        seen[(round, name)] = rows

    server: Any = _RecordingBroadcasts(protocol, broadcasts)
    run_local_nodes(server, dict(units), privatizer, progress=False, observe=observe)
    releases: list[tuple[Release, Tensor]] = []
    by_round: dict[int, int] = {}
    for release, value in privatizer.published:
        if release.mechanism == "local_gaussian":
            at = by_round.get(release.round, 0)
            by_round[release.round] = at + 1
            value = seen[(release.round, protocol.stat_specs(release.round)[at].name)]
        releases.append((release, value))
    return Published(tuple(broadcasts), tuple(releases)), privatizer.ledger


def node_side_plan(
    design: CanaryDesign, cfg: Any, canaries: int, options: RuntimeOptions
) -> tuple[Protocol, RuntimeOptions, Callable[[int], PublishingPrivatizer]]:
    """The canary protocol under ``options.dp_model`` (distributed or local), the options its nodes run
    with, and a factory of its publishing privatizers (one per run, by noise seed). The nodes'
    mechanism is solved from the protocol's own calibration, as a run's is
    (:func:`fedpers.runtime.distributed.node_side_privatizer`). Local DP puts one canary on each node,
    so a node's noisy vector is that canary's own release; distributed DP splits the canaries over
    ``min(nodes, canaries)`` nodes (their shares sum to the release's noise whatever the split)."""
    from fedpers.privacy.distributed import RecordingCalibrations
    from fedpers.runtime.distributed import node_side_privatizer, with_node_noise

    if options.node_dropout > 0:
        raise ValueError("node_dropout: an audit's nodes all reply (audit without --node-dropout)")
    if options.dp_model is DpModel.LOCAL:
        options = dataclasses.replace(options, nodes=canaries, users_per_node=1, min_nodes=0)
    else:
        nodes = min(int(options.nodes), canaries)
        if options.min_nodes > nodes:
            raise ValueError(
                f"min_nodes must be at most the audit's nodes min(nodes, canaries) = {nodes}; got {options.min_nodes}"
            )
        options = dataclasses.replace(options, nodes=nodes, users_per_node=0)
    recorded = RecordingCalibrations()
    protocol = design.protocol(cfg, canaries, recorded)
    template = node_side_privatizer(protocol, canaries, recorded, options, 0, derived_seed(int(cfg.seed), "rotation"))
    protocol = with_node_noise(protocol, template, canaries)
    plan = template.plan
    kind = PublishingLocalPrivatizer if options.dp_model is DpModel.LOCAL else PublishingDistributedPrivatizer
    return protocol, options, lambda seed: kind(seed, plan)


def _flat(spec: StatSpec, stat: Tensor) -> Tensor:
    """A statistic in the flat form the nodes encode it in (the upper triangle of a symmetric one)."""
    return flatten(stat.unsqueeze(0), spec.shape, spec.symmetric)[0]


def _released_part(release: Release, value: Tensor) -> Tensor:
    """The coordinates that carry independent noise: the upper triangle of a symmetric release."""
    if release.mechanism == "symmetric_gaussian":
        rows, cols = torch.triu_indices(value.shape[0], value.shape[1])
        return value[rows, cols]
    return value.flatten()


@dataclass(frozen=True)
class CanaryScores:
    """Each canary's log-likelihood ratio and what it is compared with, from published outputs only.

    ``llr``: Σ_releases <Y − M, c⁺_i − c⁻_i>/σ²; ``gram``: Σ_releases <c⁺_i − c⁻_i, c⁺_j − c⁻_j>/σ²
    (K × K). Under the ledger's claim, llr_i = ±gram_ii/2 + noise of variance gram_ii + the other
    canaries' interference Σ_{j≠i} ±gram_ij/2 (their coins are fair and independent), so
    ``standard`` = llr_i/√v_i with v_i = gram_ii + Σ_{j≠i} gram_ij²/4 has mean ±``separation``/2
    and variance 1, ``separation`` = gram_ii/√v_i. Orthogonal canaries have gram diagonal: no
    interference, and the separation is √gram_ii."""

    llr: Tensor
    gram: Tensor

    @property
    def variance(self) -> Tensor:
        off = self.gram - torch.diag(torch.diagonal(self.gram))
        return torch.diagonal(self.gram) + (off**2).sum(1) / 4

    @property
    def standard(self) -> Tensor:
        return self.llr / self.variance.clamp_min(1e-300).sqrt()

    @property
    def separation(self) -> Tensor:
        return torch.diagonal(self.gram) / self.variance.clamp_min(1e-300).sqrt()


def score_canaries(protocol: Protocol, published: Published, canaries: Canaries) -> tuple[Tensor, Tensor]:
    """Log-likelihood ratio of "+" vs "−" for every canary, from the published outputs only, and each
    canary's own separation μ_i = sqrt(Σ ||c⁺_i − c⁻_i||²/σ²) (see :func:`canary_scores`)."""
    scored = canary_scores(protocol, published, canaries)
    return scored.llr, torch.diagonal(scored.gram).sqrt()


def canary_scores(
    protocol: Protocol,
    published: Published,
    canaries: Canaries,
    only: frozenset[str] | None = None,
    steer: Steer | None = None,
    present: int | None = None,
) -> CanaryScores:
    """White-box scores: for release Y = S + N(0, σ²) the LLR of canary i is <Y − M, c⁺_i − c⁻_i>/σ²,
    summed over releases, with c^± the canary's contribution under each version (recomputed from the
    broadcast and the canary's own data) and M the sum of every canary's midpoint (c⁺+c⁻)/2; the
    canaries' directions need not be orthogonal (their interference is in :class:`CanaryScores`).
    Each contribution is compared in the form it is released in
    (:attr:`~fedpers.experiments.hooks.Canaries.as_released`). ``only``: score just the releases of
    these statistic names (the others are left out of the LLR and the gram alike); ``steer``: each
    round's canaries rebuilt from its published broadcast (what the run was given, see :func:`audit`);
    ``present``: only the first ``present`` canaries are in the run (the rest are empty null slots,
    see :func:`null_scores`), so only theirs enter M."""
    by_round: dict[int, list[tuple[Release, Tensor]]] = {}
    for release, value in published.releases:
        by_round.setdefault(release.round, []).append((release, value))
    k = canaries.count
    llr = torch.zeros(k, dtype=torch.float64)
    gram = torch.zeros(k, k, dtype=torch.float64)
    streams: dict[str, list[tuple[Release, Tensor, Tensor, Tensor]]] = {}
    for r, released in sorted(by_round.items()):
        specs = protocol.stat_specs(r)
        if len(specs) != len(released):
            raise ValueError(f"round {r}: {len(released)} releases for {len(specs)} statistics")
        broadcast = published.broadcasts[r]
        now = canaries if steer is None else steer(r, broadcast)
        contrib = {v: [client_message(protocol, r, broadcast, now.one(i, v)).stats for i in range(k)] for v in "+-"}
        for spec, (release, value) in zip(specs, released):
            if only is not None and spec.name not in only:
                continue
            if release.noise_std <= 0:
                raise ValueError(f"release {release.name!r} has no noise: nothing to audit (epsilon must be finite)")
            if release.mechanism in NODE_SIDE_MECHANISMS:  # compared in the flat form the nodes noised
                plus = torch.stack([_flat(spec, c[spec.name]) for c in contrib["+"]])
                minus = torch.stack([_flat(spec, c[spec.name]) for c in contrib["-"]])
            else:
                plus = torch.stack(
                    [
                        _released_part(release, canaries.as_released(spec.name, c[spec.name]).double())
                        for c in contrib["+"]
                    ]
                )
                minus = torch.stack(
                    [
                        _released_part(release, canaries.as_released(spec.name, c[spec.name]).double())
                        for c in contrib["-"]
                    ]
                )
            if release.mechanism == "correlated_gaussian":  # scored with the stream's other rounds, below
                streams.setdefault(spec.name, []).append(
                    (release, _released_part(release, value.double()), plus, minus)
                )
                continue
            diff = plus - minus
            if release.mechanism == "local_gaussian":
                # one canary per node (unit id = node): canary i sees its own node's noisy vector, in which
                # only the canaries of that node (a null slot shares a present canary's id) have data
                ids = canaries.plus["ids"].long()
                mids = torch.zeros_like(value, dtype=torch.float64)
                mids.index_add_(0, ids[:present], ((plus + minus) / 2)[:present])
                centred_rows = value.double()[ids] - mids[ids]
                llr += (diff * centred_rows).sum(1) / release.noise_std**2
                gram += (diff @ diff.T) * (ids[:, None] == ids[None, :]) / release.noise_std**2
                continue
            flat_value = _flat(spec, value.double()) if release.mechanism in NODE_SIDE_MECHANISMS else value.double()
            centred = (
                flat_value if release.mechanism in NODE_SIDE_MECHANISMS else _released_part(release, flat_value)
            ) - ((plus + minus) / 2)[:present].sum(0)
            llr += (diff @ centred) / release.noise_std**2
            gram += (diff @ diff.T) / release.noise_std**2
    for name, stream in streams.items():
        stream_llr, stream_gram = _decorrelated_scores(protocol, name, stream, present)
        llr += stream_llr
        gram += stream_gram
    return CanaryScores(llr, gram)


def _decorrelated_scores(
    protocol: Protocol, name: str, stream: list[tuple[Release, Tensor, Tensor, Tensor]], present: int | None
) -> tuple[Tensor, Tensor]:
    """The LLR and gram of a correlated stream (:meth:`~fedpers.privacy.Privatizer.correlated_gaussian_sum`):
    its T releases are Y = X + σ·C⁻¹Z (rounds stacked, Z i.i.d. N(0, 1)), so CY = CX + σZ is the
    Gaussian mechanism on CX with independent noise, and the Neyman–Pearson score of canary i is
    ⟨C(Y − M), C(G⁺_i − G⁻_i)⟩/σ² — the projection of the decorrelated releases on what the canary
    moves CX by across the rounds it takes part in. (The prefix sums AY carry the same information
    but correlated noise: projecting them, or the raw releases, without whitening is not the
    likelihood ratio.) C is the protocol's public strategy, checked against the releases' digest."""
    correlated = getattr(protocol, "correlated", None)
    if correlated is None:
        raise ValueError(f"stream {name!r}: correlated releases from a protocol without a correlated strategy")
    stream = sorted(stream, key=lambda item: int(item[0].params["step"]))
    first = stream[0][0]
    T = int(first.params["horizon"])
    if [int(item[0].params["step"]) for item in stream] != list(range(T)):
        raise ValueError(f"stream {name!r}: the audit scores a whole stream; got steps of {T}")
    if first.params["strategy_digest"] != correlated.strategy.digest():
        raise ValueError(f"stream {name!r}: released with another strategy than the protocol's")
    sigma = float(first.noise_std)
    if sigma <= 0:
        raise ValueError(f"release {first.name!r} has no noise: nothing to audit (epsilon must be finite)")
    C = correlated.strategy.matrix(T).to(torch.float64)
    Y = torch.stack([item[1] for item in stream])  # (T, d)
    plus = torch.stack([item[2] for item in stream])  # (T, K, d)
    minus = torch.stack([item[3] for item in stream])
    centred = C @ (Y - ((plus + minus) / 2)[:, :present].sum(1))
    diff = torch.einsum("ts,skd->tkd", C, plus - minus)
    llr = torch.einsum("tkd,td->k", diff, centred) / sigma**2
    gram = torch.einsum("tkd,tjd->kj", diff, diff) / sigma**2
    return llr, gram


# ----- null slots: the "left-out" law measured on empty coordinates ------------------------------
NULL_SLOTS_PER_RUN = 1000
"""At most this many empty canary slots are scored per run (the rest of the design's capacity)."""


def with_null_slots(cans: Canaries, present: int) -> Canaries:
    """``cans`` whose slots from ``present`` on are null slots: they carry the present canaries' ids in
    turn (slot j: id j mod ``present``), so a slot's contributions — computed, never sent — fall in
    the same cohorts and Poisson samples as a present canary's. Only the first ``present`` slots
    enter the run (:func:`present_only`)."""
    ids = cans.plus["ids"]
    if ids.shape[0] == present:
        return cans
    mapped = ids.clone()
    mapped[present:] = ids[torch.arange(present, ids.shape[0]) % present]
    plus, minus = dict(cans.plus), dict(cans.minus)
    plus["ids"], minus["ids"] = mapped, mapped.clone()
    return Canaries(plus, minus, cans.design, cans.as_released)


def present_only(cans: Canaries, present: int) -> Canaries:
    """The first ``present`` canaries of ``cans`` (the run's population)."""
    cut = {k: v[:present] for k, v in cans.plus.items()}, {k: v[:present] for k, v in cans.minus.items()}
    return Canaries(cut[0], cut[1], cans.design, cans.as_released)


def in_role_scores(scored: CanaryScores, included: Tensor) -> Tensor:
    """Each canary's standardised score against the version it does NOT hold: ±standard_i + separation_i/2
    (+ for "+"), i.e. ⟨Y − M₋ᵢ − c_i^other, c_i^held − c_i^other⟩/σ² over √v_i. Under the ledger's
    Gaussian claim it is N(separation_i, 1) whichever version the canary holds, and it would be
    N(0, 1) — the law of an empty slot's score — had the canary held the other one."""
    sign = included.double() * 2 - 1
    return sign * scored.standard + scored.separation / 2


def null_scores(scored: CanaryScores, present: int) -> Tensor:
    """Standardised scores of the empty slots past ``present`` (pure noise: nothing was placed there;
    ``llr`` may carry leading batch dimensions).
    Refused unless every slot is orthogonal to every present canary (then no canary's data reaches
    a slot's score); a slot whose contributions are all zero is left out."""
    gram = scored.gram
    diag = torch.diagonal(gram)
    cross = gram[:present, present:]
    scale = torch.sqrt(diag[:present, None].clamp_min(0) * diag[None, present:].clamp_min(0))
    if bool((cross.abs() > 1e-9 * scale.clamp_min(1e-300)).any()):
        raise ValueError("null slots must be orthogonal to every present canary (no data of theirs reaches a slot)")
    usable = diag[present:] > 0
    return (scored.llr[..., present:] / diag[present:].clamp_min(1e-300).sqrt())[..., usable]


NULL_SCORE_ASSUMPTION = (
    "every release adds zero-mean Gaussian noise of one variance to each of its coordinates whatever the "
    "data (the ledger's Gaussian mechanism), so a canary's score against the version it does not hold has "
    "the law of an empty slot's score; both are Gaussian with one variance"
)


def proven_mu(ledger: Ledger) -> float | None:
    """μ (GDP) the ledger proves for the worst-placed user, when every release is an unsampled Gaussian."""
    groups: list[str | None] = [*ledger.groups()] or [None]
    worst = 0.0
    for g in groups:
        releases = ledger.touching(g) if g is not None else list(ledger)
        zs = accountant_lib.gaussian_multipliers(dp_accounting.ComposedDpEvent([r.event for r in releases]))
        if zs is None:
            return None
        worst = max(worst, accountant_lib.gaussian_mu([z / 2 for z in zs]))
    return worst


def audit(
    exp: Experiment,
    cfg: Any,
    canaries: int,
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
    """``runs`` independent runs of ``exp`` on ``canaries`` canaries each; lower bounds beside the proven ε.

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
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    if placement == "steered" and design.steer is None:
        raise ValueError(f"placement: {exp.name}'s canary design has no steered placement")
    if placement == "random" and design.random_canaries is None:
        raise ValueError(f"placement: {exp.name}'s canary design has no random placement; use orthogonal")
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
        steer = _bound_steer(design, protocol, slots) if placement == "steered" else None
        steered = None if steer is None else _steered_units(steer, included, canaries)
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
    gauss_null = _null_slot_bound(torch.cat(in_role), torch.cat(nulls), confidence) if spare else None
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
            "epsilon": _gdp_epsilon(gauss["mu"], delta),
            "epsilon_lower": _gdp_epsilon(gauss["mu_lower"], delta),
            "assumption": audit_math.GAUSSIAN_SCORE_ASSUMPTION,
        },
        "gaussian_score_null": None
        if gauss_null is None
        else {
            **gauss_null,
            "epsilon": _gdp_epsilon(gauss_null["mu"], delta),
            "epsilon_lower": _gdp_epsilon(gauss_null["mu_lower"], delta),
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


def skellam_gaussian_mu(ledger: Ledger) -> float | None:
    """For a ledger of Skellam releases (distributed DP), the μ of Gaussian releases with the same
    variance and L2 sensitivity, sqrt(Σ Δ₂²/V) for the worst-placed user: the reference a score test
    approaches (Skellam tends to the Gaussian as V grows at fixed Δ₂/√V). Not a proven bound: the proven
    ε is the Skellam RDP bound's, which lies above ε(μ) by the integer term and the RDP conversion."""
    groups: list[str | None] = [*ledger.groups()] or [None]
    worst, any_skellam = 0.0, False
    for g in groups:
        releases = ledger.touching(g) if g is not None else list(ledger)
        total = 0.0
        for r in releases:
            if isinstance(r.event, SkellamDpEvent):
                any_skellam = True
                total += r.event.l2_sensitivity**2 / r.event.variance
        worst = max(worst, total)
    return math.sqrt(worst) if any_skellam else None


def _node_summary(options: RuntimeOptions, privatizer: Any) -> dict[str, Any]:
    plan = getattr(privatizer, "plan", None)
    out: dict[str, Any] = {"nodes": options.nodes, "min_nodes": options.min_nodes or options.nodes}
    if plan is not None:
        out["bits"] = plan.bits
        out["noise_multiplier"] = plan.noise_multiplier
    return out


def _bound_steer(design: CanaryDesign, protocol: Protocol, cans: Canaries) -> Steer:
    steer = design.steer
    assert steer is not None  # checked in audit() before any run

    def at(round: int, broadcast: Mapping[str, Tensor]) -> Canaries:
        return steer(protocol, round, broadcast, cans)

    return at


def _steered_units(
    steer: Steer, included: Tensor, present: int
) -> Callable[[int, Mapping[str, Tensor]], Mapping[str, Tensor]]:
    def units(round: int, broadcast: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return present_only(steer(round, broadcast), present).units(included)

    return units


def _null_slot_bound(in_role: Tensor, nulls: Tensor, confidence: float) -> dict[str, float] | None:
    """The Gaussian-score bound with every canary's in-role score against the empty slots' scores
    (:data:`NULL_SCORE_ASSUMPTION`), and the two samples' standard deviations for a reader to compare."""
    if in_role.numel() < 2 or nulls.numel() < 2:
        return None
    both = torch.cat([in_role, nulls])
    which = torch.cat([torch.ones(in_role.numel(), dtype=torch.bool), torch.zeros(nulls.numel(), dtype=torch.bool)])
    out = audit_math.gaussian_score_mu(both, which, confidence)
    return {**out, "null_scores": int(nulls.numel()), "sd_in": float(in_role.std()), "sd_null": float(nulls.std())}


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


def _gdp_epsilon(mu: float, delta: float) -> float:
    return accountant_lib.analytic_gaussian_epsilon(mu, delta) if mu > 0 else 0.0


SCORES = ("threshold", "gaussian")


def headline(result: Mapping[str, Any], score: str = "threshold") -> str:
    """The one line a report leads with: the chosen bound's ε lower bound and its ratio to the proven ε.
    ``threshold``: the largest non-parametric bound (valid for any mechanism or under the GDP claim);
    ``gaussian``: the Gaussian-score lower bound, with its assumption named."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {', '.join(SCORES)}; got {score!r}")
    proven = float(result["proven_epsilon"])
    if score == "gaussian":
        null = result.get("gaussian_score_null")
        gauss = null or result.get("gaussian_score")
        if gauss is None:
            return "  headline (Gaussian score): none (a side of the coins has fewer than 2 canaries)"
        bound = float(gauss["epsilon_lower"])
        what = (
            "Gaussian score against empty slots, assuming i.i.d. Gaussian noise"
            if null
            else "Gaussian score, assuming Gaussian scores"
        )
    else:
        bound = max(
            float(result["epsilon_lower"]),
            float(result["one_run_gdp"]["epsilon_lower"]),
            float(result["independent_gdp"]["epsilon_lower"]),
        )
        what = "threshold, non-parametric"
    ratio = f" = {bound / proven:.2f} × proven ε {proven:.4g}" if proven > 0 else ""
    return f"  headline ({what}): ε ≥ {bound:.4g}{ratio}"


def format_audit(result: Mapping[str, Any], score: str = "threshold") -> str:
    """A short report: the chosen headline bound, then proven ε beside each empirical lower bound,
    and what was tested."""
    mu = result["proven_mu"]
    one, gdp, ind = result["one_run"], result["one_run_gdp"], result["independent_gdp"]
    proven = f"  proven ε = {result['proven_epsilon']:.4g}" + (f" (μ-GDP, μ = {mu:.4g})" if mu is not None else "")
    if result.get("audited_releases", "all") != "all":
        proven += (
            f" for the audited releases {', '.join(result['audited_releases'])} alone"
            f" (the whole run: ε = {result['run_proven_epsilon']:.4g})"
        )
    lines = [
        f"audit of {result['algorithm']}: {result['runs']} run(s) × {result['canaries_per_run']} canaries, "
        f"confidence {result['confidence']}, δ = {result['delta']:.3g}",
        f"  neighbours: {result['neighbouring']}",
        f"  releases tested: {result['releases_tested']}",
        headline(result, score),
        f"  canaries: {result['canary_design']} (separation μ = {result['canary_mu']:.3f})",
        proven,
        f"  empirical ε lower bound, any mechanism (Steinke et al. 2023): {result['epsilon_lower']:.4g}  [{one['correct']}/{one['guesses']} guesses right]",
        f"  μ-GDP claim rejected up to μ = {gdp['mu_lower']:.4g} (one run, Mahloujifar et al. 2024): ε ≥ {gdp['epsilon_lower']:.4g}",
        f"  μ lower bound, canaries as independent trials (Clopper–Pearson): {ind['mu_lower']:.4g}: ε ≥ {ind['epsilon_lower']:.4g}",
    ]
    gauss = result.get("gaussian_score")
    if gauss is not None:
        lines.append(
            f"  Gaussian-score bound, ASSUMING {gauss['assumption']}:\n    μ = {gauss['mu']:.4g} "
            f"[{gauss['confidence']:g} lower bound {gauss['mu_lower']:.4g}]: ε ≈ {gauss['epsilon']:.4g}, ε ≥ {gauss['epsilon_lower']:.4g}"
        )
    null = result.get("gaussian_score_null")
    if null is not None:
        lines.append(
            f"  null-slot Gaussian-score bound ({null['n_in']} canaries' scores against the version they do not hold, "
            f"{null['null_scores']} empty slots' scores; sd {null['sd_in']:.3f} and {null['sd_null']:.3f}), "
            f"ASSUMING {null['assumption']}:\n    μ = {null['mu']:.4g} [{null['confidence']:g} lower bound "
            f"{null['mu_lower']:.4g}]: ε ≈ {null['epsilon']:.4g}, ε ≥ {null['epsilon_lower']:.4g}"
        )
    if result.get("dp_model", "central") != "central":
        nodes = result.get("nodes") or {}
        where = (
            "each canary alone on its node, scored on that node's own noisy vector (what the server receives)"
            if result["dp_model"] == "local"
            else f"{nodes.get('nodes')} nodes (min_nodes {nodes.get('min_nodes')}, {nodes.get('bits')} bits), scored on "
            "the decoded modular sum (all that secure aggregation shows the server)"
        )
        lines.append(f"  trust model: {result['dp_model']} DP, the nodes' mechanism simulated exactly; {where}")
    if result.get("skellam_gaussian_mu") is not None:
        lines.append(
            f"  Skellam releases: a Gaussian of the same variance and sensitivity would be μ = "
            f"{result['skellam_gaussian_mu']:.4g} (ε = {_gdp_epsilon(result['skellam_gaussian_mu'], result['delta']):.4g}); "
            "the proven ε is the Skellam RDP bound's"
        )
    if "placement" in result:
        lines.append(
            f"  placement: {result['placement']}; {result['trials']} canary trials in {result['seconds']:.1f} s"
            + (" through the Flower runtime" if result.get("runtime") == "flower" else "")
        )
    return "\n".join(lines)


# ----- a finished run directory ---------------------------------------------------------------
AUDIT_FILE = "audit.json"
"""What ``fedpers audit RUN_DIR`` writes into the run directory (the HTML report shows it)."""


def audit_run_dir(
    run_dir: Any,
    canaries: int,
    runs: int = 1,
    confidence: float = 0.95,
    seed: int = 0,
    placement: str = "auto",
    releases: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Audit the configuration a finished run used (its canaries replace the population; everything
    else as configured, its trust model included, on the local runtime), beside the (ε, δ) its own
    ledger records; written to RUN_DIR/audit.json."""
    import json
    from pathlib import Path

    from fedpers import config as config_lib
    from fedpers.commands.privacy_report import privacy_summary
    from fedpers.experiments import ALGORITHMS, experiment
    from fedpers.results.rundir import dumps, write_atomic

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
    result = audit(
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
    ledger = privacy_summary(path)
    result["run_dir"] = str(path)
    result["run_ledger"] = {k: ledger.get(k) for k in ("epsilon", "delta", "accountant", "releases", "complete")}
    write_atomic(path / AUDIT_FILE, dumps(result) + "\n")
    return result


def format_run_audit(result: Mapping[str, Any], score: str = "threshold") -> str:
    """The audit's report, with the run's own ledger first."""
    led = result["run_ledger"]
    head = (
        f"run {result['run_dir']}: its ledger records ε = {led['epsilon']:.4g} at δ = {led['delta']:.3g} "
        f"({led['accountant']}, {led['releases']} releases); the audit reruns its configuration on canaries"
    )
    return head + "\n" + format_audit(result, score) + f"\n  written to {result['run_dir']}/{AUDIT_FILE}"
