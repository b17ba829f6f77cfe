"""The local runtime under distributed or local DP: nodes simulated exactly, without the cryptography.

Units are split over the nodes as the Flower runtime splits them (:func:`unit_ranges`). In each
round every node computes each of its units' own contribution, a chunk of units at a time
(:meth:`~fedpers.protocols.base.Protocol.unit_statistics`, batched, where the protocol provides it;
else ``client_message`` on each unit alone), encodes them with :mod:`fedpers.privacy.distributed`
(distributed: scaled, rotated, conditionally rounded, summed, its Skellam share added, reduced mod
2^b; local: each unit's own Gaussian added) and the vectors are summed as secure aggregation would
(mod 2^b). The server
decodes the sum and hands it to the protocol's ``server_update`` through the
:class:`~fedpers.privacy.distributed.NodeSidePrivatizer`, which records the release. Modular
wraps (known here only because the simulation also holds the unreduced integer sum) are counted
in the round's record as ``modular_wraps``, beside ``suspected_wraps``: what the server alone can flag
from the sum it decodes, as the Flower runtime records it.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from fedpers import linalg, pools
from fedpers.config import DpModel, Neighbours
from fedpers.configs.runtime import Runtime, RuntimeOptions
from fedpers.data.units import UnitSource
from fedpers.privacy import distributed as dist
from fedpers.privacy import secagg
from fedpers.privacy.accountant import Calibrations, meets_target
from fedpers.privacy.refusal import RefusedBeforeRelease
from fedpers.protocols.base import Message, NodeSide, Protocol, StatSpec, Units, unit_contributions
from fedpers.runtime.checkpoint import Checkpointer
from fedpers.runtime.driver import ClientReply, RoundFailed, RoundRecord, drive
from fedpers.runtime.flower.partition import unit_ranges

Tensor = torch.Tensor
_T = TypeVar("_T")
log = logging.getLogger("fedpers.nodes")


def dropouts(rate: float, seed: int) -> Callable[[int, int], bool]:
    """``survive(round, node)`` for nodes that drop out independently with probability ``rate`` each
    round, from a public seed (so whether a round has enough survivors never depends on the data)."""

    def survive(round: int, node: int) -> bool:
        tag = f"fedpers-dropout:{int(seed)}:{int(round)}:{int(node)}".encode()
        u = int.from_bytes(hashlib.sha256(tag).digest()[:8], "little") / 2**64
        return u >= rate

    return survive


Aggregate = Callable[[int, str, Tensor, int], Tensor]
"""(round, statistic, the nodes' vectors reduced mod 2^b (nodes, D), b) → their sum mod 2^b."""

Observe = Callable[[int, str, Tensor, Sequence[int]], None]
"""(round, statistic, the nodes' vectors (survivors, d), the survivors' node indices): what the server
receives in the clear under local DP (each node's noisy vector). Never called under distributed DP,
where secure aggregation shows the server the modular sum only."""


def declared(protocol: Protocol, model: DpModel = DpModel.DISTRIBUTED) -> NodeSide:
    """The protocol's own :class:`~fedpers.protocols.base.NodeSide` declaration; a ValueError quoting its
    refusal reason when this configuration cannot be noised on the nodes (before any work)."""
    found = protocol.node_side()
    if isinstance(found, str):
        raise ValueError(f"dp_model {model.value} does not support {found} (or use --dp-model central)")
    return found


def stat_shapes(protocol: Protocol) -> list[dist.StatShape]:
    """Every statistic the protocol sums, over all its rounds (the plan's input)."""
    psd = set(declared(protocol).psd_statistics)
    return [
        dist.StatShape(s.name, tuple(s.shape), float(s.per_unit_bound), bool(s.symmetric), s.name in psd)
        for r in range(protocol.num_rounds)
        for s in protocol.stat_specs(r)
    ]


PSD_SLACK = 1e-12
"""A unit's declared-PSD matrix passes as it is when it plus ``PSD_SLACK``·‖A‖_F·I has a Cholesky factor:
its eigenvalues are ≥ −(1e-12 + 5e-15)·‖A‖_F, which moves the inner product of two units' triangles by
< 1e-11·√n·‖A‖‖A'‖ — far inside the (1 + 1e-9) the tightened Δ₂ allows (:attr:`StatEncoding.l2_sensitivity`)."""


def psd_rows(matrices: Tensor) -> Tensor:
    """(U, n, n) finite units' contributions declared PSD → (U, n, n) float64, each the symmetric matrix of
    its upper triangle (what is encoded), PSD to within :data:`PSD_SLACK`: a batched Cholesky check, and
    the units it fails (none, for the protocol's statistics: PSD by construction) projected onto the PSD
    cone (negative eigenvalues set to 0), which never raises the Frobenius norm, so a unit stays within
    its bound. What keeps the √2 bound's premise for float32 statistics and for any bug."""
    m = matrices.detach().to(device="cpu", dtype=torch.float64)
    if m.numel() == 0:
        return m
    n = m.shape[-1]
    upper = torch.ones(n, n, dtype=torch.bool).triu()
    m = torch.where(upper, m, m.transpose(1, 2))
    shifted = m.clone()
    shifted.diagonal(dim1=1, dim2=2).add_((PSD_SLACK * torch.linalg.matrix_norm(m)).unsqueeze(1))
    fails = (torch.linalg.cholesky_ex(shifted).info != 0).nonzero().squeeze(1)
    if fails.numel():
        lam, vec = torch.linalg.eigh(m[fails])
        m[fails] = (vec * lam.clamp_min(0.0).unsqueeze(1)) @ vec.transpose(1, 2)
    return m


def unit_rows(
    protocol: Protocol,
    round: int,
    broadcast: Mapping[str, Tensor],
    part: Units,
    members: Tensor,
    specs: Sequence[StatSpec],
    *,
    batched: bool = True,
) -> tuple[dict[str, Tensor], Tensor, int]:
    """One chunk's per-unit contributions of the units in ``members`` (sorted ids) that take part in the round, (U, d)
    float64 per statistic (flattened as encoded; a PSD statistic's units by :func:`psd_rows`), their ids
    (U,) and how many were zeroed (:func:`~fedpers.protocols.base.unit_contributions`; ``batched`` False:
    ``client_update`` unit by unit, the reference)."""
    ids = part["ids"].cpu()
    at = torch.searchsorted(members, ids).clamp_(max=max(int(members.numel()) - 1, 0))
    inside = members[at] == ids if members.numel() else torch.zeros_like(ids, dtype=torch.bool)
    if not bool(inside.all()):
        part = {k: v[inside.to(v.device)] for k, v in part.items()}
    if int(part["ids"].shape[0]) == 0:
        return (
            {s.name: torch.zeros(0, dist.flat_dim(s.shape, s.symmetric)) for s in specs},
            torch.zeros(0, dtype=torch.int64),
            0,
        )
    got, zeroed = unit_contributions(protocol, round, broadcast, part, batched=batched)
    psd = set(declared(protocol).psd_statistics)
    rows = {
        s.name: dist.flatten(psd_rows(got.stats[s.name]) if s.name in psd else got.stats[s.name], s.shape, s.symmetric)
        for s in specs
    }
    return rows, got.ids.cpu(), zeroed


def encode_rows(
    rows: Mapping[str, Tensor], ids: Tensor, specs: Sequence[StatSpec], privatizer: dist.NodeSidePrivatizer, round: int
) -> dict[str, Tensor]:
    """What a batch of one node's units adds to its vectors: distributed, the sum of their scaled, rotated,
    conditionally rounded rows (int64); local, the sum of their rows each with its own Gaussian. Both re-clip
    every row to its statistic's bound B first (:func:`~fedpers.privacy.distributed.clip_rows`). Each unit
    draws from its own key (:func:`~fedpers.privacy.distributed.unit_keys`, OS entropy with ``secure``),
    so replacing one unit moves only that unit's encoded row, and a unit's draws do not depend on the
    chunk or node it is computed in."""
    plan = privatizer.plan
    out = {}
    for s in specs:
        enc = plan.encodings[s.name]
        if plan.model == dist.DpModel.DISTRIBUTED:
            draws = dist.unit_randomness(privatizer.noise_seed, round, s.name, ids, privatizer.secure)
            out[s.name] = dist.encode_units(rows[s.name], enc, draws)
        else:
            draws = dist.unit_randomness(privatizer.noise_seed, round, s.name, ids, privatizer.secure, "noise")
            clipped = dist.clip_rows(rows[s.name], enc.bound)  # B holds for every unit, as the rounding's re-clip
            out[s.name] = dist.local_gaussian(clipped, plan.noise_multiplier * enc.bound, draws, privatizer.secure)
    return out


def node_vectors(
    encoded: Mapping[str, Tensor],
    specs: Sequence[StatSpec],
    privatizer: dist.NodeSidePrivatizer,
    round: int,
    generator: torch.Generator,
) -> dict[str, Tensor]:
    """What one node sends for each statistic, from its units' :func:`encode_rows` summed: distributed,
    plus its noise share from ``generator`` (not yet reduced: the simulation counts wraps); local, as is."""
    plan = privatizer.plan
    if plan.model != dist.DpModel.DISTRIBUTED:
        return dict(encoded)
    return {s.name: encoded[s.name] + dist.noise_share(plan.encodings[s.name], plan.honest, generator) for s in specs}


SHARE_UNITS = 256
"""Fewest units per share of a chunk in :func:`in_shares`."""


def in_shares(work: Callable[[Units], _T], units: Units) -> list[_T]:
    """``work`` on up to :data:`~fedpers.linalg.KRON_STREAMS` contiguous shares of ``units`` (at least
    :data:`SHARE_UNITS` each), each on a pool thread with torch single-threaded, results in the shares'
    order. A node's per-unit work is many ops on a chunk that threads split and then wait for (on a busy
    2-core machine one unscheduled thread stalls every op: a chunk's hashing measured 1.4–95 ms threaded,
    2.6–9.7 ms on one thread); the split depends on the chunk's size alone, so every path sums the same
    shares in the same order."""
    n = int(units["ids"].shape[0])
    parts = max(1, min(linalg.KRON_STREAMS, linalg.thread_budget(), n // SHARE_UNITS))
    bounds = [n * i // parts for i in range(parts + 1)]

    def one(i: int) -> _T:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return work({k: v[bounds[i] : bounds[i + 1]] for k, v in units.items()})
        finally:
            torch.set_num_threads(threads)

    if parts == 1:
        return [one(0)]
    return list(pools.pool(parts).map(one, range(parts)))


NODE_CHUNK_BYTES = 64 << 20
"""Bytes of the dense per-unit rows a node encodes at once: a chunk holds at most this many bytes of its
units' encoded vectors (units × Σ D coordinates, float64; :func:`node_chunk`), the encoding's temporaries
(rotation, rounding draws) a few such arrays. Binds only where a unit's vector is long (DPALS: items ×
(k(k+1)/2 + k) coordinates a user), never at AltMin's, FedRep's, NoisyGD's or NoisyHead's sizes."""


def node_chunk(chunk_size: int, specs: Sequence[StatSpec], plan: dist.DistributedPlan) -> int:
    """Units a node encodes at once: ``chunk_size``, or fewer where their dense rows would pass
    :data:`NODE_CHUNK_BYTES` (at least one). Public: a function of the plan's shapes alone."""
    distributed = plan.model == dist.DpModel.DISTRIBUTED
    per_unit = 8 * sum(
        plan.encodings[s.name].padded if distributed else dist.flat_dim(s.shape, s.symmetric) for s in specs
    )
    return max(1, min(chunk_size, NODE_CHUNK_BYTES // max(1, per_unit)))


class NodeEncoder:
    """One node's round, its units added a part at a time (:meth:`add`), then its message (:meth:`message`):
    each unit's own contribution (:func:`unit_rows`) encoded (:func:`encode_rows`) at most ``chunk_size``
    units at a time (fewer where their dense rows would pass :data:`NODE_CHUNK_BYTES`) in :func:`in_shares`,
    no more than a chunk of units' rows ever held, summed; the node's noise share added last
    (:func:`node_vectors`). Every runtime's node goes through here."""

    def __init__(
        self,
        protocol: Protocol,
        round: int,
        broadcast: Mapping[str, Tensor],
        privatizer: dist.NodeSidePrivatizer,
        node: int,
        members: Tensor,
        *,
        batched: bool = True,
        chunk_size: int = 4096,
    ) -> None:
        self.protocol, self.round, self.broadcast, self.privatizer = protocol, round, broadcast, privatizer
        self.node, self.members, self.batched = node, members, batched
        self.specs = protocol.stat_specs(round)
        self.chunk_size = node_chunk(chunk_size, self.specs, privatizer.plan)
        distributed = privatizer.plan.model == dist.DpModel.DISTRIBUTED
        self.total: dict[str, Tensor] = {
            s.name: torch.zeros(
                privatizer.plan.encodings[s.name].padded if distributed else dist.flat_dim(s.shape, s.symmetric),
                dtype=torch.int64 if distributed else torch.float64,
            )
            for s in self.specs
        }
        self.count = self.zeroed = 0

    def _encoded(self, piece: Units) -> tuple[dict[str, Tensor], int, int]:
        rows, ids, zr = unit_rows(
            self.protocol, self.round, self.broadcast, piece, self.members, self.specs, batched=self.batched
        )
        if ids.numel() == 0:
            return {}, 0, 0
        return encode_rows(rows, ids, self.specs, self.privatizer, self.round), int(ids.numel()), zr

    def add(self, part: Units) -> None:
        """Add the units of ``part`` that are this node's ``members`` and take part in the round."""
        for start in range(0, int(part["ids"].shape[0]), self.chunk_size):
            piece = {k: v[start : start + self.chunk_size] for k, v in part.items()}
            for values, c, zr in in_shares(self._encoded, piece):
                for name, value in values.items():
                    self.total[name] += value
                self.count, self.zeroed = self.count + c, self.zeroed + zr

    def message(self) -> Message:
        """The node's vectors (not yet reduced mod 2^b), its unit count and zeroed count."""
        p = self.privatizer
        generator = dist.node_generator(p.noise_seed, self.round, self.node, p.secure)
        return Message(node_vectors(self.total, self.specs, p, self.round, generator), self.count, self.zeroed)


def encode_node(
    protocol: Protocol,
    round: int,
    broadcast: Mapping[str, Tensor],
    parts: Iterable[Units],
    members: Tensor,
    privatizer: dist.NodeSidePrivatizer,
    node: int,
    *,
    batched: bool = True,
    chunk_size: int = 4096,
) -> Message:
    """One node's message of a round from its ``parts`` (:class:`NodeEncoder`)."""
    encoder = NodeEncoder(protocol, round, broadcast, privatizer, node, members, batched=batched, chunk_size=chunk_size)
    for part in parts:
        encoder.add(part)
    return encoder.message()


def nodes_draw_membership(
    protocol: Protocol,
    round: int,
    broadcast: Mapping[str, Tensor],
    privatizer: dist.NodeSidePrivatizer,
    ranges: Sequence[range],
    num_units: int,
) -> Mapping[str, Tensor]:
    """The broadcast the nodes of ``ranges`` work from: under Poisson sampling (the protocol's declared rate
    q < 1) the server's membership ``sampled`` (of all ``num_units`` units) is replaced by each node's own
    draw for its units (:func:`~fedpers.privacy.distributed.node_membership`; units outside ``ranges``: not
    sampled), so the sample the ledger's amplification rests on is never the server's choice nor known to it.
    Refused for local DP (its noise is per unit; the sample would amplify nothing against the node) and for a
    membership the protocol did not declare."""
    rate = declared(protocol, privatizer.plan.model).sampling_rate
    if "sampled" not in broadcast:
        return broadcast
    if rate >= 1.0:
        raise ValueError(f"{protocol.name} broadcasts a Poisson membership but declares no sampling rate")
    if privatizer.plan.model is not DpModel.DISTRIBUTED:
        raise ValueError(f"dp_model {privatizer.plan.model.value} does not support Poisson sampling")
    server = broadcast["sampled"]
    if server.shape != (num_units,) or any(not 0 <= r.start <= r.stop <= num_units for r in ranges):
        raise ValueError(f"{protocol.name}'s membership covers {tuple(server.shape)}, not the nodes' {num_units} units")
    mine = torch.zeros(server.shape, dtype=server.dtype)
    for span in ranges:
        ids = torch.arange(span.start, span.stop)
        mine[span.start : span.stop] = dist.node_membership(
            privatizer.noise_seed, round, ids, rate, privatizer.secure
        ).to(server.dtype)
    return {**broadcast, "sampled": mine.to(server.device)}


@dataclass
class RoundSums:
    """What the server holds after one round's aggregation: each statistic decoded (``stats``), the
    modular sums it decoded them from, and the round's public unit count; beside them, the simulated nodes'
    own counts (``taking_part``, ``zeroed``), which no reply carries (:class:`NodeSummary`)."""

    stats: dict[str, Tensor]
    modular: dict[str, Tensor]
    count: int
    """The units the public plan gives the summed nodes this round (:meth:`~fedpers.protocols.base.Protocol.planned_units`): under Poisson
    cohorts those eligible before the nodes' draw, never |S|."""
    zeroed: int
    wraps: int
    survivors: int
    suspected: int = 0
    """Coordinates the server alone would flag as wrapped (:func:`~fedpers.privacy.distributed.suspected_wraps`)."""
    taking_part: int = 0
    """Operator side: the units the summed nodes' messages hold (under Poisson cohorts the sampled |S|)."""


NODE_SUMMARY_NOTE = "operator-side counts of the simulated nodes' own units, not released to the server"


@dataclass
class NodeSummary:
    """What the nodes' operators see of their own units, round by round, summed over the simulated nodes: the
    units taking part (under Poisson cohorts the sampled |S|) and those zeroed (a non-finite contribution
    entered as 0). Data-dependent, so no node reply carries them: they stay beside the run, labelled
    :data:`NODE_SUMMARY_NOTE`, as a deployment's node keeps its own in its log and node store."""

    taking_part: dict[int, int] = field(default_factory=dict)
    zeroed: dict[int, int] = field(default_factory=dict)

    def add(self, round: int, taking_part: int, zeroed: int) -> None:
        self.taking_part[round], self.zeroed[round] = taking_part, zeroed

    def to_dict(self) -> dict[str, Any]:
        return {
            "note": NODE_SUMMARY_NOTE,
            "units_taking_part": {str(r): n for r, n in sorted(self.taking_part.items())},
            "units_zeroed": {str(r): n for r, n in sorted(self.zeroed.items())},
        }


def node_round(
    protocol: Protocol,
    round: int,
    broadcast: Mapping[str, Tensor],
    source: UnitSource,
    privatizer: dist.NodeSidePrivatizer,
    *,
    chunk_size: int = 4096,
    survive: Callable[[int, int], bool] | None = None,
    aggregate: Aggregate | None = None,
    observe: Observe | None = None,
    batched: bool = True,
) -> RoundSums:
    """One round: every surviving node's vectors, their (secure) modular sum, decoded. ``observe``:
    handed each statistic's node vectors under local DP (what the server sees of them); ``batched``
    False: each unit's contribution by ``client_update`` on it alone (the reference path)."""
    plan = privatizer.plan
    ranges = list(unit_ranges(source.num_units, plan.nodes, plan.users_per_node))
    broadcast = nodes_draw_membership(protocol, round, broadcast, privatizer, ranges, source.num_units)
    ids, samples = protocol.units_needed(round, broadcast)
    specs = protocol.stat_specs(round)
    encoders: list[NodeEncoder] = []
    spans = []
    for node, span in enumerate(ranges):
        if survive is not None and not survive(round, node):
            continue
        members = torch.arange(span.start, span.stop)
        if ids is not None:
            members = members[torch.isin(members, ids.cpu())]
        encoders.append(
            NodeEncoder(protocol, round, broadcast, privatizer, node, members, batched=batched, chunk_size=chunk_size)
        )
        spans.append(span)
    # one pass over the round's units, as a central round reads them (the source draws each chunk once and
    # the next one ahead), each chunk's units routed to the nodes whose ranges hold them
    needed = [e.members for e in encoders]
    wanted = None if ids is None and len(encoders) == plan.nodes else torch.cat(needed) if needed else None
    if wanted is None or wanted.numel():
        bounds = torch.tensor([[span.start, span.stop] for span in spans], dtype=torch.int64).reshape(-1, 2)
        for part in source.needed_chunks(chunk_size, wanted, samples):
            part_ids = part["ids"].cpu()  # ascending, as every source yields them
            at = torch.searchsorted(part_ids, bounds).tolist()
            for encoder, (lo, hi) in zip(encoders, at, strict=True):
                if hi > lo:
                    encoder.add({k: v[lo:hi] for k, v in part.items()})
    messages = [e.message() for e in encoders]
    sent = [m.stats for m in messages]
    nodes = [e.node for e in encoders]
    # the nodes' own counts stay with their operators; the server's count is the plan's
    taking_part, zeroed = sum(m.count for m in messages), sum(m.zeroed for m in messages)
    count = protocol.planned_units(round, spans)
    if len(sent) < plan.min_nodes:
        raise RoundFailed(
            f"round {round}: {len(sent)} of {plan.nodes} nodes survived, below min_nodes={plan.min_nodes}; "
            "the round is discarded before any release"
        )
    if plan.model == dist.DpModel.DISTRIBUTED and len(sent) < plan.nodes:  # as SecAgg+'s nodes would refuse
        why = secagg.unmaskable(
            nodes, secagg.plus_graph(plan.nodes, round), secagg.plus_threshold(plan.nodes), plan.min_nodes
        )
        if why is not None:
            raise RoundFailed(
                f"round {round}: SecAgg+ would not unmask ({why}); the round is discarded before any release"
            )
    stats: dict[str, Tensor] = {}
    sums: dict[str, Tensor] = {}
    wraps = suspected = 0
    for s in specs:
        vectors = torch.stack([v[s.name] for v in sent])
        if plan.model == dist.DpModel.DISTRIBUTED:
            enc = plan.encodings[s.name]
            reduced = dist.modular(vectors, enc.bits)
            if aggregate is None:
                modular = dist.modular(reduced.sum(dim=0), enc.bits)
            else:
                modular = aggregate(round, s.name, reduced, enc.bits)
            wraps += int((dist.centered(modular, enc.bits) != vectors.sum(dim=0)).sum())
            suspected += dist.suspected_wraps(modular, enc)
            value = dist.decode(modular, enc)
            sums[s.name] = modular
        else:
            if observe is not None:
                observe(round, s.name, vectors.detach().clone(), tuple(nodes))
            value = dist.unflatten(vectors.sum(dim=0), s.shape, s.symmetric)
        stats[s.name] = value.to(dtype=protocol.dtype, device=source.device)
    return RoundSums(stats, sums, count, zeroed, wraps, len(sent), suspected, taking_part)


def secagg_aggregate(degree: int | None = None, threshold: int | None = None, seed: int = 0) -> Aggregate:
    """Sum the nodes' vectors with real SecAgg+ (:func:`fedpers.privacy.secagg.secure_sum`): the server
    side sees only masked vectors, and the result is the modular sum."""

    def aggregate(round: int, name: str, reduced: Tensor, bits: int) -> Tensor:
        inputs = {i: reduced[i].numpy() for i in range(reduced.shape[0])}
        tag = f"round{round}:{name}".encode()
        total = secagg.secure_sum(inputs, bits, degree=degree, threshold=threshold, seed=seed, round_tag=tag)
        return torch.from_numpy(total)

    return aggregate


def run_local_nodes(
    protocol: Protocol,
    units: Units | UnitSource,
    privatizer: dist.NodeSidePrivatizer,
    *,
    chunk_size: int = 4096,
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    progress: bool = True,
    checkpoint: Checkpointer | None = None,
    survive: Callable[[int, int], bool] | None = None,
    aggregate: Aggregate | None = None,
    observe: Observe | None = None,
    batched: bool = True,
    summary: NodeSummary | None = None,
) -> tuple[Any, list[RoundRecord]]:
    """Run ``protocol`` with ``privatizer.plan``'s nodes simulated. ``survive(round, node)``: whether
    a node's reply reaches the server (default: all do); a round with fewer than ``min_nodes``
    survivors is discarded before any release (:class:`RoundFailed`). ``aggregate``: how the nodes'
    reduced vectors are summed mod 2^b (default: in the clear, the simulation; :func:`secagg_aggregate`
    runs real SecAgg+ over them and must give the same sum); ``observe``: see :data:`Observe`; ``batched``
    False: each unit's contribution by ``client_update`` on it alone (the reference path, for tests).

    What the server side receives (round records, the release's count) holds only the plan's unit counts;
    the nodes' own (units taking part, units zeroed) go into ``summary`` (:class:`NodeSummary`, the operator
    side); a run that zeroed any is told so at its end (a warning of the ``fedpers.nodes`` logger)."""
    source = UnitSource.of(units)
    nodes_summary = summary if summary is not None else NodeSummary()
    n = source.num_units
    if survive is None and privatizer.dropout > 0:
        survive = dropouts(privatizer.dropout, privatizer.dropout_seed)

    def gather(round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        privatizer.begin_round()
        got = node_round(
            protocol,
            round,
            broadcast,
            source,
            privatizer,
            chunk_size=chunk_size,
            survive=survive,
            aggregate=aggregate,
            observe=observe,
            batched=batched,
        )
        nodes_summary.add(round, got.taking_part, got.zeroed)
        for name, value in got.stats.items():
            privatizer.arrived(value, name, got.survivors, got.count)
        privatizer.round_diagnostics = {"nodes_survived": float(got.survivors)}
        if privatizer.plan.model is DpModel.DISTRIBUTED:  # only a modular sum can wrap
            privatizer.round_diagnostics.update(modular_wraps=float(got.wraps), suspected_wraps=float(got.suspected))
        return [ClientReply("nodes", n, Message(got.stats, got.count), aggregate=True)]

    def record_round(record: RoundRecord, state: Any) -> None:
        record.diagnostics.update(privatizer.round_diagnostics)
        if on_round is not None:
            on_round(record, state)

    out = drive(
        protocol,
        gather,
        privatizer,
        on_round=record_round,
        progress=progress,
        device=source.device,
        checkpoint=checkpoint,
    )
    zeroed = sum(nodes_summary.zeroed.values())
    if zeroed:  # the operator's own line (stderr by default), as the data summary's counts are shown
        log.warning(
            "simulated nodes (%s): %d unit contributions zeroed (not finite) over %d rounds",
            NODE_SUMMARY_NOTE,
            zeroed,
            len(nodes_summary.zeroed),
        )
    return out


def check_calibration(calibrations: dist.RecordingCalibrations) -> None:
    """Refuse (:class:`~fedpers.privacy.refusal.RefusedBeforeRelease`) a table whose noise multiplier for the
    protocol's calibration is below what the accountant solves for that calibration's own target: the table
    travels in the job, the server's word, and under local DP the nodes add exactly its z. A z at least the
    node's own solve (its calibration cache's, bit for bit, on the server's code) passes as it is; one a little
    below (another machine's solve) passes if it meets the target at full resolution; one below 0.9 of it
    cannot (the solve's steps are at most 1 %) and is refused without an accounting at that noise (minutes
    at 1/100 of the noise)."""
    table = Calibrations(calibrations.table)  # answers from the table; solves only a key it lacks
    for (make_event, epsilon, delta, accountant), relation in zip(
        calibrations.asked, calibrations.relations, strict=True
    ):
        z = table(make_event, epsilon, delta, accountant, relation)
        own = Calibrations()(make_event, epsilon, delta, accountant, relation)
        if z >= own:
            continue
        if z < 0.9 * own or not meets_target(make_event, z, epsilon, delta, accountant, relation):
            raise RefusedBeforeRelease(
                f"the job's noise multiplier {z:.6g} does not meet its own target (epsilon={epsilon:g}, delta={delta:g} "
                f"by {accountant}: at least {own:.6g}); the nodes' noise is not lowered on the server's word"
            )


def node_side_privatizer(
    protocol: Protocol,
    num_units: int,
    calibrations: dist.RecordingCalibrations,
    options: RuntimeOptions,
    noise_seed: int,
    rotation_seed: int,
) -> dist.NodeSidePrivatizer:
    """The Privatizer of a distributed or local DP run, its plan solved from the protocol's own
    calibration. Refuses, before any release, what the nodes cannot privatise: a protocol whose
    :meth:`~fedpers.protocols.base.Protocol.node_side` gives a reason (its own declaration), or one whose
    noise the accountant calibrated more than once (the plan solves one multiplier)."""
    model = options.dp_model
    side = declared(protocol, model)
    if len(calibrations.asked) > 1:
        raise ValueError(
            f"dp_model {model.value} needs one calibrated noise multiplier; {protocol.name} asked for more"
        )
    z = side.noise_multiplier
    if z > 0 and not calibrations.asked:  # the plan solves the calibrated guarantee: never plan without one
        raise ValueError(
            f"dp_model {model.value}: {protocol.name}'s noise multiplier was not calibrated by the accountant "
            "(e.g. --calibration paper), so the nodes' mechanism cannot be solved for its guarantee; use the accountant"
        )
    stats = stat_shapes(protocol)
    nodes = options.nodes
    if side.sampling_rate < 1.0 and model is DpModel.LOCAL:
        raise ValueError(
            f"dp_model local does not support Poisson sampling ({protocol.name} samples at "
            f"{side.sampling_rate:g}): each unit's noise is its own, and its node knows whether it took part"
        )
    if model is DpModel.LOCAL:
        if calibrations.asked:  # the nodes' noise is the table's z itself: it must meet the run's own target
            check_calibration(calibrations)
        local = dist.LocalPrivatizer(
            noise_seed,
            dist.plan_local(stats, nodes=nodes, z=z, users_per_node=options.users_per_node),
            secure=options.secure_noise,
        )
        local.dropout, local.dropout_seed = options.node_dropout, rotation_seed
        return local
    relations = set(calibrations.relations)
    if len(relations) > 1:
        raise ValueError(f"dp_model {model.value}: {protocol.name} was calibrated under two neighbouring relations")
    relation = relations.pop() if relations else Neighbours.REPLACE_ONE
    if relation is not Neighbours.REPLACE_ONE and options.runtime is not Runtime.LOCAL:
        raise ValueError(
            f"dp_model distributed with neighbours {relation.value} runs on the local runtime only (the Flower "
            "nodes derive a replace-one plan)"
        )
    plan = dist.plan_distributed(
        stats,
        units=num_units,
        nodes=nodes,
        min_nodes=options.min_nodes or nodes,
        bits=options.bits,
        seed=rotation_seed,
        calibration=calibrations.asked[0] if calibrations.asked and z > 0 else None,
        central_z=z,
        users_per_node=options.users_per_node,
        collusion=options.collusion,
        release_ratio=z / next(iter(calibrations.table.values())) if len(calibrations.table) == 1 and z > 0 else 1.0,
        neighbours=relation,
    )
    privatizer = dist.DistributedPrivatizer(noise_seed, plan, secure=options.secure_noise)
    privatizer.dropout, privatizer.dropout_seed = options.node_dropout, rotation_seed
    return privatizer


def with_node_noise(protocol: Protocol, privatizer: dist.NodeSidePrivatizer, num_units: int) -> Protocol:
    """The protocol with its ``noise_multiplier`` set so the noise it assumes after a release (its
    PSD floor, its noise diagnostics: public post-processing) is the noise the nodes add, never less.

    Distributed: each statistic's noise std is z·Δ₂/(2s) in its own units; local: the sum of up to n units'
    own noise has std √n·z·B; against the protocol's z·B (z·B/√2 for a PSD statistic): the largest ratio
    is taken. Spends no privacy: the ledger records what the nodes did, whatever this says."""
    side = declared(protocol, privatizer.plan.model)
    z = side.noise_multiplier
    if z == 0:
        return protocol
    plan = privatizer.plan
    psd = set(side.psd_statistics)
    # each statistic's noise std over the protocol's z·Δ/2 (Δ = 2B, or √2B for a PSD one centrally)
    # (add-remove: σ = z·B, never tightened)
    central = {
        e.name: z * (math.sqrt(2.0) if e.name in psd and not e.add_remove else 2.0) * e.bound / 2
        for e in plan.encodings.values()
    }
    if plan.model is DpModel.LOCAL:
        actual = {e.name: math.sqrt(num_units) * z * e.bound for e in plan.encodings.values()}
    else:
        actual = {e.name: plan.noise_multiplier * e.noise_scale / e.scale for e in plan.encodings.values()}
    factor = max(actual[k] / central[k] for k in actual)
    return protocol.with_noise_multiplier(z * factor)
