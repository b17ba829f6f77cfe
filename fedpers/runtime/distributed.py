"""The local runtime under distributed or local DP: nodes simulated exactly, without the cryptography.

Units are split over the nodes as the Flower runtime splits them (:func:`unit_ranges`). In each
round every node computes each of its units' contribution (``client_message`` on that unit
alone), encodes them with :mod:`fedpers.privacy.distributed` (distributed: scaled, rotated,
conditionally rounded, summed, its Skellam share added, reduced mod 2^b; local: each unit's own
Gaussian added) and the vectors are summed as secure aggregation would (mod 2^b). The server
decodes the sum and hands it to the protocol's ``server_update`` through the
:class:`~fedpers.privacy.distributed.NodeSidePrivatizer`, which records the release. Modular
wraps (known here only because the simulation also holds the unreduced integer sum) are counted
in the round's record as ``modular_wraps``, beside ``suspected_wraps``: what the server alone can flag
from the sum it decodes, as the Flower runtime records it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedpers.config import DpModel
from fedpers.configs.runtime import RuntimeOptions
from fedpers.data.units import UnitSource
from fedpers.privacy import distributed as dist
from fedpers.privacy import secagg
from fedpers.protocols.base import Message, NodeSide, Protocol, StatSpec, Units, client_message
from fedpers.runtime.checkpoint import Checkpointer
from fedpers.runtime.driver import ClientReply, RoundFailed, RoundRecord, drive
from fedpers.runtime.flower.partition import unit_ranges

Tensor = torch.Tensor


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


def psd_part(matrix: Tensor) -> Tensor:
    """A unit's contribution declared PSD, projected onto the PSD cone in float64 (negative eigenvalues
    set to 0): a no-op up to rounding for the protocol's statistics (PSD by construction), and what keeps
    the √2 bound's premise exact for float32 statistics and for any bug. The projection never raises
    the Frobenius norm, so the unit stays within its bound."""
    m = matrix.detach().to(device="cpu", dtype=torch.float64)
    if m.numel() == 0 or not bool(torch.isfinite(m).all()):
        return m
    lam, vec = torch.linalg.eigh((m + m.T) / 2)
    return (vec * lam.clamp_min(0.0)) @ vec.T


def unit_rows(
    protocol: Protocol,
    round: int,
    broadcast: Mapping[str, Tensor],
    parts: Any,
    members: Tensor,
    specs: Sequence[StatSpec],
) -> tuple[dict[str, Tensor], list[int], int, int]:
    """One node's per-unit contributions, (U, d) float64 per statistic (units of ``members`` only,
    those taking part in the round), the units' ids (one per row), the unit count and the zeroed count."""
    rows: dict[str, list[Tensor]] = {s.name: [] for s in specs}
    psd = set(declared(protocol).psd_statistics)
    ids: list[int] = []
    counts = [0, 0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one unit's statistics are tiny: threads only add their start-up, on a busy machine 10×
    try:
        for part in parts:
            inside = torch.isin(part["ids"].cpu(), members)
            for i in inside.nonzero().squeeze(1).tolist():
                one: Units = {k: v[i : i + 1] for k, v in part.items()}
                msg = client_message(protocol, round, broadcast, one)
                if msg.count == 0:
                    continue
                ids.append(int(part["ids"][i]))
                counts[0], counts[1] = counts[0] + msg.count, counts[1] + msg.zeroed
                for s in specs:
                    value = psd_part(msg.stats[s.name]) if s.name in psd else msg.stats[s.name]
                    rows[s.name].append(dist.flatten(value.unsqueeze(0), s.shape, s.symmetric))
    finally:
        torch.set_num_threads(threads)
    out = {
        s.name: torch.cat(rows[s.name]) if rows[s.name] else torch.zeros(0, dist.flat_dim(s.shape, s.symmetric))
        for s in specs
    }
    return out, ids, counts[0], counts[1]


def node_vectors(
    rows: Mapping[str, Tensor],
    ids: Sequence[int],
    specs: Sequence[StatSpec],
    privatizer: dist.NodeSidePrivatizer,
    round: int,
    generator: torch.Generator,
) -> dict[str, Tensor]:
    """What one node sends for each statistic: distributed, its integer sum plus its noise share
    (not yet reduced: the simulation counts wraps); local, its units' noisy sum. Each unit is rounded
    with its own generator (:func:`~fedpers.privacy.distributed.unit_generator`), so replacing one unit
    moves only that unit's rounded vector; the node's noise share comes from ``generator``."""
    plan = privatizer.plan
    out = {}
    for s in specs:
        enc = plan.encodings[s.name]
        if plan.model == dist.DpModel.DISTRIBUTED:
            units = [dist.unit_generator(privatizer.noise_seed, round, s.name, u, privatizer.secure) for u in ids]
            out[s.name] = dist.encode_units(rows[s.name], enc, units) + dist.noise_share(enc, plan.min_nodes, generator)
        else:
            out[s.name] = dist.local_gaussian(
                rows[s.name], plan.noise_multiplier * enc.bound, generator, privatizer.secure
            )
    return out


@dataclass
class RoundSums:
    """What the server holds after one round's aggregation: each statistic decoded (``stats``), the
    modular sums it decoded them from, and the round's counts."""

    stats: dict[str, Tensor]
    modular: dict[str, Tensor]
    count: int
    zeroed: int
    wraps: int
    survivors: int
    suspected: int = 0
    """Coordinates the server alone would flag as wrapped (:func:`~fedpers.privacy.distributed.suspected_wraps`)."""


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
) -> RoundSums:
    """One round: every surviving node's vectors, their (secure) modular sum, decoded. ``observe``:
    handed each statistic's node vectors under local DP (what the server sees of them)."""
    plan = privatizer.plan
    ids, samples = protocol.units_needed(round, broadcast)
    specs = protocol.stat_specs(round)
    sent: list[dict[str, Tensor]] = []
    nodes: list[int] = []
    count = zeroed = 0
    for node, span in enumerate(unit_ranges(source.num_units, plan.nodes, plan.users_per_node)):
        members = torch.arange(span.start, span.stop)
        if ids is not None:
            members = members[torch.isin(members, ids.cpu())]
        if survive is not None and not survive(round, node):
            continue
        parts = source.needed_chunks(chunk_size, members, samples) if members.numel() else []
        rows, unit_ids, c, zr = unit_rows(protocol, round, broadcast, parts, members, specs)
        generator = dist.node_generator(privatizer.noise_seed, round, node, privatizer.secure)
        sent.append(node_vectors(rows, unit_ids, specs, privatizer, round, generator))
        nodes.append(node)
        count, zeroed = count + c, zeroed + zr
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
    return RoundSums(stats, sums, count, zeroed, wraps, len(sent), suspected)


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
) -> tuple[Any, list[RoundRecord]]:
    """Run ``protocol`` with ``privatizer.plan``'s nodes simulated. ``survive(round, node)``: whether
    a node's reply reaches the server (default: all do); a round with fewer than ``min_nodes``
    survivors is discarded before any release (:class:`RoundFailed`). ``aggregate``: how the nodes'
    reduced vectors are summed mod 2^b (default: in the clear, the simulation; :func:`secagg_aggregate`
    runs real SecAgg+ over them and must give the same sum); ``observe``: see :data:`Observe`."""
    source = UnitSource.of(units)
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
        )
        for name, value in got.stats.items():
            privatizer.arrived(value, name, got.survivors, got.count)
        privatizer.round_diagnostics = {"nodes_survived": float(got.survivors)}
        if privatizer.plan.model is DpModel.DISTRIBUTED:  # only a modular sum can wrap
            privatizer.round_diagnostics.update(modular_wraps=float(got.wraps), suspected_wraps=float(got.suspected))
        return [ClientReply("nodes", n, Message(got.stats, got.count, got.zeroed), aggregate=True)]

    def record_round(record: RoundRecord, state: Any) -> None:
        record.diagnostics.update(privatizer.round_diagnostics)
        if on_round is not None:
            on_round(record, state)

    return drive(
        protocol,
        gather,
        privatizer,
        on_round=record_round,
        progress=progress,
        device=source.device,
        checkpoint=checkpoint,
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
    if model is DpModel.LOCAL:
        local = dist.LocalPrivatizer(
            noise_seed,
            dist.plan_local(stats, nodes=nodes, z=z, users_per_node=options.users_per_node),
            secure=options.secure_noise,
        )
        local.dropout, local.dropout_seed = options.node_dropout, rotation_seed
        return local
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
        release_ratio=z / next(iter(calibrations.table.values())) if len(calibrations.table) == 1 and z > 0 else 1.0,
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
    central = {e.name: z * (math.sqrt(2.0) if e.name in psd else 2.0) * e.bound / 2 for e in plan.encodings.values()}
    if plan.model is DpModel.LOCAL:
        actual = {e.name: math.sqrt(num_units) * z * e.bound for e in plan.encodings.values()}
    else:
        actual = {e.name: plan.noise_multiplier * e.l2_sensitivity / 2 / e.scale for e in plan.encodings.values()}
    factor = max(actual[k] / central[k] for k in actual)
    return protocol.with_noise_multiplier(z * factor)
