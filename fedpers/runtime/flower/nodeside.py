"""Distributed and local DP on the Flower runtime: each node noises its own sum, the server only adds.

The run's trust model (dp_model, nodes, min_nodes, bits) is part of the job every node pins
(:class:`~fedpers.runtime.flower.codec.Trust`). A node derives the public plan
(:class:`~fedpers.privacy.distributed.DistributedPlan`: scales, rotation seed, bounds, noise variance,
bits) from the job itself and refuses a task whose plan differs (:func:`check_plan`); it never takes
its noise from a message: in a deployment it draws from its own OS entropy, and only the simulation's
ClientApp, built by the lab that runs both sides, may seed it (:class:`NodeSettings`). It computes each
of its units' own contribution, encodes them exactly as the local runtime's simulated nodes do
(:func:`fedpers.runtime.distributed.encode_node`: distributed, scaled, rotated, conditionally rounded,
summed, its Skellam share added, reduced mod 2^b; local, each unit's own Gaussian added) and replies
with that vector only. The server sums the vectors (mod 2^b), decodes the sum and hands it to the
protocol through the :class:`~fedpers.privacy.distributed.NodeSidePrivatizer`, which records the release.

Broadcasts follow from releases: the server's update is then a deterministic function of the released
sums, so each task carries the previous round's released sums and the node derives the broadcast
itself (:func:`derive_broadcast`: its own copy of the server's state, advanced one round at a time in
``context.state``), refuses a task whose broadcast differs from the one it derives, and computes on its
own. A round is reachable only after the round before it: a stolen session can neither choose U nor ask
round 150 of 300.

What the server receives under distributed DP: each node's vector *masked* by SecAgg+
(:mod:`fedpers.runtime.flower.secaggplus`, five Message stages per round), from which it recovers
only the sum mod 2^b of the survivors that signed one survivor set; under local DP, each node's noisy
float sum in the clear. Nothing else the data decides: the reply's unit and zeroed counts are 0 (the
server counts the units the public plan gives the summed nodes), and the node's own counts (units taking
part, under Poisson its sampled users; units zeroed) stay with its operator (:func:`node_summary`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, RecordDict

from fedpers.config import DpModel
from fedpers.privacy import distributed as dist
from fedpers.protocols.base import Message, Protocol, Units
from fedpers.runtime.driver import ClientReply, RoundFailed, RoundRecord
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.policy import PolicyRefused

Tensor = torch.Tensor
NODE_SIDE = "fedpers.node-side"
"""Task record key: the public plan a node noises its sum with, and the previous round's release (absent
under central DP)."""
RELEASED = "fedpers.released"
"""Task ArrayRecord key of the previous round's released sums when they exceed :data:`codec.INLINE_BYTES`."""
PLAN = "plan"
RELEASE_ROUND, RELEASE_COUNT, RELEASE_NODES = "release-round", "release-count", "release-nodes"
SEED, SECURE, NODE = "noise-seed", "secure", "node"
"""Fields a node never takes from a message (its noise and its identity are its own): a task carrying one
is refused (rule ``node-noise``)."""
CHAIN = "fedpers.chain"
"""``context.state`` record: the server state this node derived for the run's latest round it reached."""
COMPUTED = "fedpers.computed"
"""``context.state`` record: the rounds this node computed in this run. Each is computed once: a second
computation of a round would add fresh noise to the same statistic, a release the plan never charges (with a
lab policy the node's store answers an identical repeat with the stored reply before this is reached)."""


@dataclass(frozen=True)
class NodeSettings:
    """What a node's own configuration, never a message, says of its noise. ``noise_seed``: the seeded
    stream of the Flower simulation (the lab runs both sides and wants the local runtime's bits); None,
    the node's OS entropy (a deployment's ClientApp always)."""

    noise_seed: int | None = None


@dataclass(frozen=True)
class NodeSidePlan:
    """What a node derives from the job for its trust model: the noise plan and the protocol the server
    updates with (its noise assumed after releases: :func:`fedpers.runtime.distributed.with_node_noise`)."""

    plan: dist.DistributedPlan
    server_protocol: Protocol


@dataclass(frozen=True)
class Released:
    """One round's released sums as the server decoded them, and what the nodes replay them with."""

    round: int
    stats: dict[str, Tensor]
    count: int
    """The units the public plan gave the summed nodes (never |S|)."""
    nodes: int


def plan_json(plan: dist.DistributedPlan) -> str:
    """The plan as JSON (floats round-trip exactly)."""
    return json.dumps(
        {
            **{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "encodings"},
            "model": plan.model.value,
            "encodings": {k: dataclasses.asdict(e) for k, e in plan.encodings.items()},
        },
        sort_keys=True,
    )


def read_plan(text: str) -> dist.DistributedPlan:
    """:func:`plan_json`'s inverse; a malformed plan raises ValueError (the node refuses the task)."""
    try:
        raw = json.loads(text)
        encs = {
            k: dist.StatEncoding(**{**e, "shape": tuple(int(n) for n in e["shape"])})
            for k, e in raw.pop("encodings").items()
        }
        return dist.DistributedPlan(**{**raw, "model": DpModel(raw["model"]), "encodings": encs})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{NODE_SIDE}: malformed plan ({type(e).__name__}: {e})") from None


def task_record(
    privatizer: dist.NodeSidePrivatizer, node: int, secure: Any = None, released: Released | None = None
) -> dict[str, Any]:
    """What partition ``node``'s task carries beside the job: the plan, the previous round's released sums
    (the node derives the broadcast from them) and, under distributed DP, the SecAgg+ ciphertexts relayed
    to it (``secure``: the round's :class:`~fedpers.runtime.flower.secaggplus.SecAggRounds`). No noise seed
    and no node identity: a node takes neither from a message."""
    rec = ConfigRecord({PLAN: plan_json(privatizer.plan), RELEASE_ROUND: -1})
    content: dict[str, Any] = {NODE_SIDE: rec}
    if released is not None:
        rec[RELEASE_ROUND], rec[RELEASE_COUNT] = int(released.round), int(released.count)
        rec[RELEASE_NODES] = int(released.nodes)
        codec.pack(released.stats).into(rec, content, RELEASED)
    if secure is not None:
        for key, value in secure.task_fields(node).items():
            rec[key] = value
    return content


def check_plan(text: str, plan: dist.DistributedPlan, derived: dist.DistributedPlan) -> None:
    """Refuse a plan that differs from the one the node derives from the public job (noise, scales, bounds,
    bits, rotation): a server cannot lower the noise a node adds, whatever it sends."""
    if plan_json(derived) != plan_json(plan):
        raise PolicyRefused(
            "plan-noise", f"{NODE_SIDE}: the plan sent differs from the one this node derives from the job"
        )


@dataclass(frozen=True)
class NodeCounts:
    """A node's own counts of a round, for its operator only (they depend on the data: no reply carries them):
    its units taking part (under Poisson cohorts, the users its own draw sampled) and those zeroed."""

    round: int
    taking_part: int
    zeroed: int


def node_message(
    protocol: Protocol,
    round: int,
    broadcast: Mapping[str, Tensor],
    units: Units,
    start: int,
    stop: int,
    plan: dist.DistributedPlan,
    partition: int,
    settings: NodeSettings,
    num_units: int = 0,
) -> tuple[Message, NodeCounts]:
    """Node side: this node's vector per statistic (distributed: int64 mod 2^b, still to be masked; local:
    its units' noisy sum), each unit's contribution encoded on its own as the local runtime's nodes do
    (:func:`fedpers.runtime.distributed.encode_node`), from the plan the node derived and with noise from
    its own settings (OS entropy unless its own config seeds it). Under Poisson cohorts the node draws its
    own units' membership as the local runtime's nodes do (any ``sampled`` in ``broadcast`` is replaced;
    ``num_units``: the run's units). The message carries the vectors only (counts 0); the node's own counts
    come beside it, for its operator (:func:`node_summary`)."""
    from fedpers.runtime.distributed import encode_node, nodes_draw_membership

    secure = settings.noise_seed is None
    seed = 0 if settings.noise_seed is None else int(settings.noise_seed)
    privatizer: dist.NodeSidePrivatizer = (
        dist.DistributedPrivatizer(seed, plan, secure=secure)
        if plan.model is DpModel.DISTRIBUTED
        else dist.LocalPrivatizer(seed, plan, secure=secure)
    )
    if "sampled" in broadcast:  # the node's own draw over the run's units (its job's count)
        broadcast = nodes_draw_membership(protocol, round, broadcast, privatizer, [range(start, stop)], num_units)
    ids, _ = protocol.units_needed(round, broadcast)
    members = torch.arange(start, stop)
    if ids is not None:
        members = members[torch.isin(members, ids.cpu())]
    message = encode_node(protocol, round, broadcast, [units], members, privatizer, partition)
    counts = NodeCounts(round, message.count, message.zeroed)
    if plan.model is DpModel.DISTRIBUTED:
        return Message({k: dist.modular(v, plan.encodings[k].bits) for k, v in message.stats.items()}, 0), counts
    return Message(message.stats, 0), counts


NODE_SUMMARY_NOTE = "this node's own counts, for its operator: not released"


def node_summary(counts: NodeCounts, gate: Any = None) -> None:
    """Show a node's operator its own counts of a round: a line in the node's log and, with a lab policy, the
    run's entry in its node store (:meth:`~fedpers.runtime.flower.nodeplan.NodeGate.summary`)."""
    import logging

    logging.getLogger("fedpers.flower").log(
        logging.WARNING if counts.zeroed else logging.INFO,  # a zeroed unit is shown to its operator by default
        "round %d (%s): units taking part %d, units zeroed %d",
        counts.round,
        NODE_SUMMARY_NOTE,
        counts.taking_part,
        counts.zeroed,
    )
    if gate is not None:
        gate.summary(counts.round, {"units_taking_part": counts.taking_part, "units_zeroed": counts.zeroed})


# ----- broadcasts follow from releases -------------------------------------------------------------
_derived: OrderedDict[tuple[str, int, str], bytes] = OrderedDict()
"""(job key, round, chain digest) → the state derived for it, serialised: nodes in one process share it."""
DERIVED_CACHE = 8


def _dump(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _load_state(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _refuse(rule: str, message: str) -> PolicyRefused:
    return PolicyRefused(rule, f"{NODE_SIDE}: {message}")


def _int(rec: ConfigRecord, key: str, default: int | None = None) -> int:
    value = rec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer; got {type(value).__name__}")
    return value


def _blob(rec: ConfigRecord, key: str) -> bytes:
    value = rec[key]
    if not isinstance(value, bytes):
        raise ValueError(f"{key} must be bytes; got {type(value).__name__}")
    return value


def _release(rec: ConfigRecord, content: RecordDict) -> tuple[int, dict[str, Tensor], int, int, str]:
    """(round, sums, count, nodes, digest) of the release a task carries (round −1: none)."""
    try:
        round = _int(rec, RELEASE_ROUND, -1)
        if round < 0:
            return -1, {}, 0, 0, ""
        stats = codec.unpack(rec, content, "release", RELEASED)
        count, nodes = _int(rec, RELEASE_COUNT), _int(rec, RELEASE_NODES)
    except (codec.MalformedReply, KeyError, TypeError, ValueError) as e:
        raise _refuse("plan-broadcast", f"malformed release ({type(e).__name__}: {e})") from None
    h = hashlib.sha256(f"release:{round}:{count}:{nodes}".encode())
    for name in sorted(stats):
        h.update(f";{name}:{stats[name].dtype}:{tuple(stats[name].shape)}:".encode())
        h.update(stats[name].contiguous().numpy().tobytes())
    return round, stats, count, nodes, h.hexdigest()


def _replay(side: NodeSidePlan, round: int, state: Any, stats: dict[str, Tensor], count: int, nodes: int) -> Any:
    """The server's update of ``round`` from the released sums alone (its privatizer adds nothing)."""
    protocol, plan = side.server_protocol, side.plan
    specs = {s.name: s for s in protocol.stat_specs(round)}
    if set(stats) != set(specs) or any(tuple(stats[k].shape) != tuple(specs[k].shape) for k in specs):
        raise _refuse(
            "plan-broadcast", f"the release of round {round} is not the protocol's statistics {sorted(specs)}"
        )
    privatizer: dist.NodeSidePrivatizer = (
        dist.DistributedPrivatizer(0, plan) if plan.model is DpModel.DISTRIBUTED else dist.LocalPrivatizer(0, plan)
    )
    privatizer.begin_round()
    summed = {k: v.to(protocol.dtype) for k, v in stats.items()}
    for name, value in summed.items():
        privatizer.arrived(value, name, nodes, count)
    try:
        new, _ = protocol.server_update(round, state, Message(summed, count), privatizer)
    except Exception as e:  # a release the protocol cannot update from is no release of this run
        raise _refuse("plan-broadcast", f"the release of round {round} does not update the state ({e})") from None
    return new


def derive_broadcast(
    context: Context, job: codec.Job, side: NodeSidePlan, round: int, rec: ConfigRecord, content: RecordDict
) -> dict[str, Tensor]:
    """The broadcast of ``round`` as the protocol derives it from the run's public releases: round 0's from
    the public initial state, round r's from the state this node derived for round r − 1 and the release of
    round r − 1 the task carries. The state advances one round at a time in ``context.state`` (refused:
    a round not reachable from it, or a round already derived from another release)."""
    key = hashlib.sha256(job.key.encode()).hexdigest()[:32]
    held = context.state.config_records.get(CHAIN)
    release_round, stats, count, nodes, digest = _release(rec, content)
    protocol = side.server_protocol
    if round == 0:
        if release_round != -1:
            raise _refuse("plan-broadcast", "round 0 follows no release")
        chain = hashlib.sha256(f"start:{key}".encode()).hexdigest()
        found = _derived.get((key, 0, chain))
        state = (
            protocol.server_start(protocol.initial_state(), dist.DistributedPrivatizer(0, side.plan))
            if found is None
            else _load_state(found)
        )
    else:
        if release_round != round - 1:
            raise _refuse("plan-broadcast", f"the task for round {round} must carry round {round - 1}'s release")
        if held is None or str(held.get("job", "")) != key:
            raise _refuse(
                "plan-reachable",
                f"round {round} is not reachable: this node derived no state of this run (a run starts at round 0)",
            )
        at = int(str(held["round"]))
        if at == round:  # derived already (a repeated task): only from the same release
            if str(held["release"]) != digest:
                raise _refuse(
                    "plan-broadcast", f"round {round}'s state was derived from another release of round {round - 1}"
                )
            chain, state = str(held["chain"]), _load_state(_blob(held, "state"))
        elif at == round - 1:
            chain = hashlib.sha256(f"{held['chain']!s}:{digest}".encode()).hexdigest()
            found = _derived.get((key, round, chain))
            if found is None:
                state = _replay(side, round - 1, _load_state(_blob(held, "state")), stats, count, nodes)
            else:
                state = _load_state(found)
        else:
            raise _refuse(
                "plan-reachable", f"round {round} is not reachable: this node derived the state of round {at}"
            )
    data = _dump(state)
    _derived[(key, round, chain)] = data
    _derived.move_to_end((key, round, chain))
    while len(_derived) > DERIVED_CACHE:
        _derived.popitem(last=False)
    context.state.config_records[CHAIN] = ConfigRecord(
        {"job": key, "round": int(round), "chain": chain, "release": digest, "state": data}
    )
    return protocol.broadcast(state, round)


def check_broadcast(derived: Mapping[str, Tensor], sent: Mapping[str, Tensor], round: int) -> None:
    """Refuse a task whose broadcast is not the one the node derives: names, shapes and dtypes equal, values
    equal up to the rounding of another machine's floating point (each tensor within 10³ machine epsilons
    of its largest entry). A Poisson membership ``sampled`` is not compared: the node draws its own units'
    (:func:`node_message` replaces it, or refuses a protocol that declares no sampling rate), so whatever
    the server sent there moves nothing the node releases."""
    if set(derived) != set(sent):
        raise _refuse(
            "plan-broadcast", f"round {round}'s broadcast names {sorted(sent)}, the protocol derives {sorted(derived)}"
        )
    for name, mine in derived.items():
        if name == "sampled":
            continue
        theirs = sent[name]
        if tuple(theirs.shape) != tuple(mine.shape) or theirs.dtype != mine.dtype:
            raise _refuse("plan-broadcast", f"round {round}'s broadcast {name!r} is not the one this node derives")
        a, b = mine.detach().cpu(), theirs.detach().cpu()
        if a.is_floating_point():
            scale = float(a.abs().max()) if a.numel() else 0.0
            tolerance = 1e3 * torch.finfo(a.dtype).eps * max(scale, 1.0)
            same = bool(torch.isfinite(b).all()) and (a.numel() == 0 or float((a - b).abs().max()) <= tolerance)
        else:
            same = torch.equal(a, b)
        if not same:
            raise _refuse(
                "plan-broadcast",
                f"round {round}'s broadcast {name!r} differs from the one the protocol derives from the run's releases",
            )


def _computed(context: Context) -> list[int]:
    held = context.state.config_records.get(COMPUTED)
    rounds = [] if held is None else held.get("rounds", [])
    return [int(r) for r in rounds] if isinstance(rounds, list) else []


def check_once(context: Context, round: int) -> None:
    """Refuse (rule ``plan-once``) a round this node already computed in this run."""
    if int(round) in _computed(context):
        raise _refuse("plan-once", f"round {round} was already computed in this run; each round is released once")


def mark_computed(context: Context, round: int) -> None:
    """Record that this node computed ``round`` (:func:`check_once`)."""
    context.state.config_records[COMPUTED] = ConfigRecord({"rounds": [*_computed(context), int(round)]})


# ----- server side ---------------------------------------------------------------------------------
class NodeSideGather:
    """``gather`` for :func:`~fedpers.runtime.driver.drive` when the nodes noise their sums: the
    inner Grid gather's replies (each a node's vector) summed mod 2^b and decoded into one aggregate
    reply. A reply that is missing, failed or malformed counts as a dropped node; fewer than the plan's
    ``min_nodes`` nodes summed discard the round before any release. The release records, and counts,
    only the nodes the sum holds (under distributed DP: the survivors SecAgg+ unmasked)."""

    def __init__(
        self,
        inner: Callable[[int, Mapping[str, Tensor]], list[ClientReply]],
        protocol: Protocol,
        privatizer: dist.NodeSidePrivatizer,
        num_units: int,
        device: torch.device | str = "cpu",
        secure: Any = None,
    ) -> None:
        self.inner, self.protocol, self.privatizer = inner, protocol, privatizer
        self.secure = secure
        """:class:`~fedpers.runtime.flower.secaggplus.SecAggRounds` (distributed DP): the vectors arrive
        masked and their sum is unmasked by SecAgg+; None (local DP): they are summed as they arrive."""
        self.num_units, self.device = num_units, device
        self.released: Released | None = None
        """The latest round's release, which the next round's tasks carry."""
        self.survive: Callable[[int, int], bool] | None = None
        if privatizer.dropout > 0:
            from fedpers.runtime.distributed import dropouts

            self.survive = dropouts(privatizer.dropout, privatizer.dropout_seed)

    def _size(self, name: str) -> int:
        """Length of entry ``name`` of a node's (masked) vector."""
        return self.privatizer.plan.encodings[name].padded

    def _vector(self, name: str, value: Tensor) -> Tensor | None:
        plan = self.privatizer.plan
        if plan.model is DpModel.DISTRIBUTED:
            ok = value.dtype == torch.int64 and tuple(value.shape) == (self._size(name),)
            return value if ok and bool(((value >= 0) & (value < 2**plan.bits)).all()) else None
        enc = plan.encodings[name]
        ok = value.dtype == torch.float64 and tuple(value.shape) == (enc.dim,)
        return value if ok and bool(torch.isfinite(value).all()) else None

    def __call__(self, round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        plan, privatizer = self.privatizer.plan, self.privatizer
        privatizer.begin_round()
        specs = self.protocol.stat_specs(round)
        if self.secure is not None:  # SecAgg+ advertise and share, before the task
            self.secure.setup(round)
        sent: dict[int, dict[str, Tensor]] = {}
        planned: dict[int, int] = {}
        names = [s.name for s in specs]
        for node, reply in enumerate(self.inner(round, broadcast)):
            if reply.message is None or (self.survive is not None and not self.survive(round, node)):
                continue
            stats = reply.message.stats
            if set(stats) != set(names):
                continue
            vectors = {name: self._vector(name, stats[name]) for name in names}
            if any(v is None for v in vectors.values()) or (reply.message.count, reply.message.zeroed) != (0, 0):
                continue  # a node's reply carries its vectors only: a count in it is not this run's node
            sent[node] = {k: v for k, v in vectors.items() if v is not None}
            planned[node] = reply.max_units  # the partition's units in the round's cohort: the public plan's
        if len(sent) < plan.min_nodes:
            raise RoundFailed(
                f"round {round}: {len(sent)} of {plan.nodes} nodes answered, below min_nodes={plan.min_nodes}; "
                "the round is discarded before any release"
            )
        sums, summed = self._sums(round, sent, names)
        if len(summed) < plan.min_nodes:  # the nodes whose input and noise the sum holds, not those that answered
            raise RoundFailed(
                f"round {round}: the sum holds {len(summed)} of {plan.nodes} nodes, below min_nodes={plan.min_nodes}; "
                "the round is discarded before any release"
            )
        count = sum(planned[p] for p in summed)  # under Poisson: the units eligible before the nodes' draws
        out: dict[str, Tensor] = {}
        suspected = 0
        for s in specs:
            total = sums[s.name]
            if plan.model is DpModel.DISTRIBUTED:
                enc = plan.encodings[s.name]
                suspected += dist.suspected_wraps(dist.modular(total, enc.bits), enc)
                value = dist.decode(dist.modular(total, enc.bits), enc)
            else:
                value = dist.unflatten(total, s.shape, s.symmetric)
            out[s.name] = value.to(dtype=self.protocol.dtype, device=self.device)
            privatizer.arrived(out[s.name], s.name, len(summed), count)
        self.released = Released(round, {k: v.detach().cpu() for k, v in out.items()}, count, len(summed))
        privatizer.round_diagnostics = {"nodes_survived": float(len(summed))}
        if plan.model is DpModel.DISTRIBUTED:  # the exact wrap count needs the unreduced sum, which no one holds
            privatizer.round_diagnostics["suspected_wraps"] = float(suspected)
        return [ClientReply("nodes", self.num_units, Message(out, count), aggregate=True)]

    def _sums(
        self, round: int, sent: Mapping[int, Mapping[str, Tensor]], entries: Sequence[str]
    ) -> tuple[dict[str, Tensor], list[int]]:
        """The ``entries``' sums, and the nodes they hold: unmasked by SecAgg+ over the survivors that signed
        (the server never adds or sees an unmasked node vector), or plainly added (local DP)."""
        if self.secure is None:
            return {k: torch.stack([v[k] for v in sent.values()]).sum(dim=0) for k in entries}, sorted(sent)
        from fedpers.runtime.flower.secaggplus import concat

        names = sorted(entries)
        sizes = [self._size(k) for k in names]
        masked = {p: concat(v, names) for p, v in sent.items()}
        total, summed = self.secure.unmask(round, masked, sum(sizes))
        return dict(zip(names, torch.split(torch.from_numpy(total), sizes), strict=True)), summed

    def on_round(self, on_round: Callable[[RoundRecord, Any], None] | None) -> Callable[[RoundRecord, Any], None]:
        """``on_round`` with each round's node diagnostics added to its record."""

        def record(record: RoundRecord, state: Any) -> None:
            record.diagnostics.update(self.privatizer.round_diagnostics)
            if on_round is not None:
                on_round(record, state)

        return record
