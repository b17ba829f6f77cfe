"""Published runs of the real protocol on every runtime: the local round loop, the Flower runtime, and
the nodes' own mechanism (distributed or local DP), each recording exactly what the server made public."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedpers.config import DpModel
from fedpers.configs.runtime import RuntimeOptions
from fedpers.data.units import UnitSource
from fedpers.experiments.base import Experiment, derived_seed
from fedpers.experiments.hooks import CanaryDesign
from fedpers.privacy import Ledger, Privatizer, Release
from fedpers.privacy.distributed import (
    DistributedPlan,
    DistributedPrivatizer,
    LocalPrivatizer,
    NodeSidePrivatizer,
)
from fedpers.protocols.base import Protocol, client_message
from fedpers.runtime.driver import ClientReply, drive

Tensor = torch.Tensor


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
        protocol = self.__dict__.get("_protocol")  # absent while unpickling in the simulation: no recursion
        if protocol is None:
            raise AttributeError(name)
        return getattr(protocol, name)

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
