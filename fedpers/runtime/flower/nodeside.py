"""Distributed and local DP on the Flower runtime: each node noises its own sum, the server only adds.

The server sends every node the public plan (:class:`~fedpers.privacy.distributed.DistributedPlan`:
scales, rotation seed, bounds, noise variance, bits) beside its task. The node computes each of its
units' contribution alone, encodes them exactly as the local runtime's simulated nodes do
(:func:`fedpers.runtime.distributed.node_vectors`: distributed, scaled, rotated, conditionally rounded,
summed, its Skellam share added, reduced mod 2^b; local, each unit's own Gaussian added) and replies
with that vector only. The server sums the vectors (mod 2^b), decodes the sum and hands it to the
protocol through the :class:`~fedpers.privacy.distributed.NodeSidePrivatizer`, which records the release.

What the server receives under distributed DP: each node's vector *masked* by SecAgg+
(:mod:`fedpers.runtime.flower.secaggplus`, four Message stages per round), from which it recovers
only the survivors' sum mod 2^b; under local DP, each node's noisy float sum in the clear. Noise seeds: with ``secure`` the nodes draw from
OS entropy and no seed travels; otherwise (reproducible simulation, equal to the local runtime) the
plan carries the run's noise seed, which the server knows as well. A node derives the plan itself
from the public job and refuses any other (:func:`check_plan`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from flwr.app import ConfigRecord

from fedpers.config import DpModel
from fedpers.privacy import distributed as dist
from fedpers.protocols.base import Message, Protocol, Units
from fedpers.runtime.driver import ClientReply, RoundFailed, RoundRecord

Tensor = torch.Tensor
NODE_SIDE = "fedpers.node-side"
"""Task record key: the public plan a node noises its sum with (absent under central DP)."""
PLAN, NODE, SEED, SECURE = "plan", "node", "noise-seed", "secure"


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


def task_record(privatizer: dist.NodeSidePrivatizer, node: int, secure: Any = None) -> ConfigRecord:
    """What partition ``node`` needs beside its task to noise its own sum (and, under distributed DP,
    the SecAgg+ ciphertexts relayed to it: ``secure`` is the round's
    :class:`~fedpers.runtime.flower.secaggplus.SecAggRounds`)."""
    rec = ConfigRecord({PLAN: plan_json(privatizer.plan), NODE: int(node), SECURE: bool(privatizer.secure)})
    if not privatizer.secure:  # reproducible simulation only: the server knows this seed too
        rec[SEED] = int(privatizer.noise_seed)
    if secure is not None:
        for key, value in secure.task_fields(node).items():
            rec[key] = value
    return rec


_checked: dict[str, bool] = {}
"""Plans (as sent) this process has already derived from their job and found equal."""


def check_plan(text: str, plan: dist.DistributedPlan, derive: Callable[[Any], Any] | None) -> None:
    """Refuse a plan the node does not derive itself from the public job (noise, scales, bounds, bits,
    rotation): a server cannot lower the noise a node adds, whatever it sends."""
    if text in _checked:
        return
    if derive is None:
        raise ValueError(
            f"{NODE_SIDE}: this node cannot derive a node-side plan; it noises nothing on the server's word"
        )
    expected = derive(plan)
    if plan_json(expected) != plan_json(plan):
        raise ValueError(f"{NODE_SIDE}: the plan sent differs from the one this node derives from the job; refused")
    _checked[text] = True


def node_message(
    protocol: Protocol,
    round: int,
    broadcast: Mapping[str, Tensor],
    units: Units,
    start: int,
    stop: int,
    rec: Any,
    derive: Callable[[Any], Any] | None = None,
    context: Any = None,
) -> Message:
    """Node side: this node's vector per statistic (distributed: int64 mod 2^b; local: its units' noisy
    sum), computed unit by unit as :func:`fedpers.runtime.distributed.node_round` does, after checking
    the plan against the one ``derive`` gives from the job (:func:`check_plan`). Under distributed DP
    the vector leaves only masked by SecAgg+ (``context`` holds the node's SecAgg+ round state): a
    task without the SecAgg+ ciphertexts is refused, never answered in the clear."""
    from fedpers.runtime.distributed import node_vectors, unit_rows

    text = str(rec[PLAN])
    plan = read_plan(text)
    check_plan(text, plan, derive)
    secure = bool(rec.get(SECURE, True))
    if not secure and SEED not in rec:
        raise ValueError(f"{NODE_SIDE}: a reproducible (not secure) plan needs its {SEED}")
    node = int(rec[NODE])
    seed = int(rec[SEED]) if not secure else 0
    privatizer: dist.NodeSidePrivatizer = (
        dist.DistributedPrivatizer(seed, plan, secure=secure)
        if plan.model is DpModel.DISTRIBUTED
        else dist.LocalPrivatizer(seed, plan, secure=secure)
    )
    ids, _ = protocol.units_needed(round, broadcast)
    members = torch.arange(start, stop)
    if ids is not None:
        members = members[torch.isin(members, ids.cpu())]
    specs = protocol.stat_specs(round)
    rows, unit_ids, count, zeroed = unit_rows(protocol, round, broadcast, [units], members, specs)
    generator = dist.node_generator(seed, round, node, secure)
    vectors = node_vectors(rows, unit_ids, specs, privatizer, round, generator)
    if plan.model is not DpModel.DISTRIBUTED:
        return Message(vectors, count, zeroed)
    from fedpers.runtime.flower.secaggplus import RELAY_IDS, masked_message

    if RELAY_IDS not in rec or context is None:
        raise ValueError(f"{NODE_SIDE}: a distributed-DP vector leaves this node only masked by SecAgg+; refused")
    vectors = {k: dist.modular(v, plan.encodings[k].bits) for k, v in vectors.items()}
    return masked_message(Message(vectors, count, zeroed), rec, context, round, plan)


class NodeSideGather:
    """``gather`` for :func:`~fedpers.runtime.driver.drive` when the nodes noise their sums: the
    inner Grid gather's replies (each a node's vector) summed mod 2^b and decoded into one aggregate
    reply. A reply that is missing, failed or malformed counts as a dropped node; fewer than the plan's
    ``min_nodes`` survivors discard the round before any release."""

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
        self.survive: Callable[[int, int], bool] | None = None
        if privatizer.dropout > 0:
            from fedpers.runtime.distributed import dropouts

            self.survive = dropouts(privatizer.dropout, privatizer.dropout_seed)

    def _vector(self, name: str, value: Tensor) -> Tensor | None:
        plan = self.privatizer.plan
        enc = plan.encodings[name]
        if plan.model is DpModel.DISTRIBUTED:
            ok = value.dtype == torch.int64 and tuple(value.shape) == (enc.padded,)
            return value if ok and bool(((value >= 0) & (value < 2**enc.bits)).all()) else None
        ok = value.dtype == torch.float64 and tuple(value.shape) == (enc.dim,)
        return value if ok and bool(torch.isfinite(value).all()) else None

    def __call__(self, round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        plan, privatizer = self.privatizer.plan, self.privatizer
        privatizer.begin_round()
        specs = self.protocol.stat_specs(round)
        if self.secure is not None:  # SecAgg+ advertise and share, before the task
            self.secure.setup(round)
        sent: dict[int, dict[str, Tensor]] = {}
        count = zeroed = 0
        for node, reply in enumerate(self.inner(round, broadcast)):
            if reply.message is None or (self.survive is not None and not self.survive(round, node)):
                continue
            stats = reply.message.stats
            if set(stats) != {s.name for s in specs}:
                continue
            vectors = {s.name: self._vector(s.name, stats[s.name]) for s in specs}
            if any(v is None for v in vectors.values()) or not 0 <= reply.message.count <= reply.max_units:
                continue
            sent[node] = {k: v for k, v in vectors.items() if v is not None}
            count, zeroed = count + reply.message.count, zeroed + reply.message.zeroed
        if len(sent) < plan.min_nodes:
            raise RoundFailed(
                f"round {round}: {len(sent)} of {plan.nodes} nodes answered, below min_nodes={plan.min_nodes}; "
                "the round is discarded before any release"
            )
        sums = self._sums(round, sent, specs)
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
            privatizer.arrived(out[s.name], s.name, len(sent), count)
        privatizer.round_diagnostics = {"nodes_survived": float(len(sent))}
        if plan.model is DpModel.DISTRIBUTED:  # the exact wrap count needs the unreduced sum, which no one holds
            privatizer.round_diagnostics["suspected_wraps"] = float(suspected)
        return [ClientReply("nodes", self.num_units, Message(out, count, zeroed), aggregate=True)]

    def _sums(self, round: int, sent: Mapping[int, Mapping[str, Tensor]], specs: Any) -> dict[str, Tensor]:
        """The statistics' sums over the nodes in ``sent``: unmasked by SecAgg+ (the server never adds
        or sees an unmasked node vector), or plainly added (local DP)."""
        if self.secure is None:
            return {s.name: torch.stack([v[s.name] for v in sent.values()]).sum(dim=0) for s in specs}
        from fedpers.runtime.flower.secaggplus import concat

        names = sorted(s.name for s in specs)
        sizes = [self.privatizer.plan.encodings[k].padded for k in names]
        masked = {p: concat(v, names) for p, v in sent.items()}
        total = torch.from_numpy(self.secure.unmask(round, masked, sum(sizes)))
        return dict(zip(names, torch.split(total, sizes), strict=True))

    def on_round(self, on_round: Callable[[RoundRecord, Any], None] | None) -> Callable[[RoundRecord, Any], None]:
        """``on_round`` with each round's node diagnostics added to its record."""

        def record(record: RoundRecord, state: Any) -> None:
            record.diagnostics.update(self.privatizer.round_diagnostics)
            if on_round is not None:
                on_round(record, state)

        return record
