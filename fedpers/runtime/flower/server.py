"""The server side of the Flower runtime: discovery, then ``drive`` with a Grid-backed gather.

Verification, dropping and the min-fraction rule are ``drive``'s, shared with the local
runtime. This module only moves messages: it finds which node holds which partition,
sends each node its task, and turns replies, client errors and timeouts into
:class:`~fedpers.runtime.driver.ClientReply` objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Message as FlowerMessage
from flwr.app import MessageType, RecordDict
from flwr.serverapp import Grid

from fedpers.privacy import Privatizer
from fedpers.protocols.base import Protocol
from fedpers.runtime.driver import ClientReply, RoundFailed, RoundRecord, drive
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.partition import unit_ranges
from fedpers.runtime.progress import phase

Tensor = torch.Tensor
log = logging.getLogger("fedpers.flower")
POLL_FIRST, POLL_MAX = 0.005, 0.1
"""Seconds between pulls for replies, growing geometrically (Grid.send_and_receive sleeps 3 s on a SuperLink)."""

REPLY_POLL_SHARE = "reply_poll_share"
"""A grid with this attribute (a fraction, e.g. 0.1) is polled for replies every that fraction of
the time already waited (at least :data:`POLL_FIRST`, at most :data:`POLL_MAX` s): a reply then waits at
most that share of the round to be seen, without more pulls than that share allows."""


class Stopped(RuntimeError):
    """The Flower runtime under this ServerApp stopped (e.g. the simulation engine crashed)."""


def _check(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise Stopped("the Flower simulation engine stopped; see its log above")


def exchange(
    grid: Grid, messages: Iterable[FlowerMessage], timeout: float, stop: Callable[[], bool] | None = None
) -> list[FlowerMessage]:
    """Push ``messages`` and pull replies until all arrived, ``timeout`` seconds passed, or ``stop()``."""
    share: float | None = getattr(grid, REPLY_POLL_SHARE, None)
    pending = set(grid.push_messages(list(messages)))
    pushed = time.monotonic()
    deadline = pushed + timeout
    replies: list[FlowerMessage] = []
    pause = POLL_FIRST
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        now = time.monotonic()
        left = deadline - now
        if not pending or left <= 0:
            break
        _check(stop)
        time.sleep(min(pause, left))
        grown = pause * 1.5 if share is None else share * (now - pushed)
        pause = min(max(grown, POLL_FIRST), POLL_MAX)
    return replies


@dataclass
class Federation:
    """Who holds what: partition index → node id, and partition index → unit-id range."""

    nodes: dict[int, int]
    ranges: list[range]
    discovery_seconds: float

    @property
    def num_partitions(self) -> int:
        return len(self.ranges)


def parse_node_partitions(text: str) -> dict[int, int]:
    """``"NODE_ID=P NODE_ID=P ..."`` → {node id: partition}; partitions must be 0..P−1, each once."""
    out: dict[int, int] = {}
    for pair in text.split():
        node, sep, part = pair.partition("=")
        if not sep or not node.isdigit() or not part.isdigit():
            raise ValueError(f"node-partitions: expected NODE_ID=PARTITION pairs of integers; got {pair!r}")
        if int(node) in out:
            raise ValueError(f"node-partitions: node {node} is listed twice")
        out[int(node)] = int(part)
    parts = sorted(out.values())
    if out and parts != list(range(len(parts))):
        raise ValueError(f"node-partitions: partitions must be 0..{len(parts) - 1}, each held by one node; got {parts}")
    return out


def assigned(
    grid: Grid, mapping: Mapping[int, int], timeout: float, stop: Callable[[], bool] | None = None
) -> tuple[dict[int, int], int]:
    """Partitions from the operator's map of authenticated node ids (``node-partitions``), not from
    what nodes say: a node not in the map takes part in nothing, whatever it claims."""
    deadline = time.monotonic() + timeout
    num = len(mapping)
    while True:
        present = set(grid.get_node_ids())
        holder = {p: node for node, p in mapping.items() if node in present}
        if len(holder) == num:
            return holder, num
        if time.monotonic() >= deadline:
            log.warning(
                "discovery: %d of %d assigned nodes connected after %g s; the others count as dropped",
                len(holder),
                num,
                timeout,
            )
            return holder, num
        _check(stop)
        time.sleep(0.05)


def discover(
    grid: Grid, job: codec.Job, timeout: float, expected: int | None = None, stop: Callable[[], bool] | None = None
) -> tuple[dict[int, int], int]:
    """Ask every node for its partition-id; wait until all partitions are held or ``timeout`` passed.

    Returns (partition → node id, number of partitions). Two nodes claiming one partition,
    or nodes disagreeing on the number of partitions, is a configuration error.
    """
    deadline = time.monotonic() + timeout
    holder: dict[int, int] = {}
    asked: set[int] = set()
    num = expected
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            asked.update(new)
            query = [FlowerMessage(RecordDict({codec.JOB: codec.job_record(job)}), n, MessageType.QUERY) for n in new]
            for reply in exchange(grid, query, max(deadline - time.monotonic(), 0.0), stop):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    log.warning("node %s failed discovery: %s", node, reply.error.reason)
                    continue
                try:
                    pid, n_parts = codec.decode_node(reply.content)
                except codec.MalformedReply as e:
                    log.warning("node %s: %s", node, e)
                    continue
                if num is None:
                    num = n_parts
                if n_parts != num:
                    raise ValueError(f"{codec.NUM_PARTITIONS}: node {node} says {n_parts}, expected {num}")
                if pid in holder:
                    raise ValueError(f"{codec.PARTITION_ID}: nodes {holder[pid]} and {node} both claim partition {pid}")
                holder[pid] = node
        if num is not None and len(holder) >= num:
            return holder, num
        if time.monotonic() >= deadline:
            if num is None:
                raise RoundFailed(f"discovery: no node reported its {codec.PARTITION_ID} within {timeout:g} s")
            log.warning(
                "discovery: %d of %d partitions have a node after %g s; the others count as dropped",
                len(holder),
                num,
                timeout,
            )
            return holder, num
        _check(stop)
        time.sleep(0.05)


class GridGather:
    """``gather`` for :func:`~fedpers.runtime.driver.drive` over a Flower Grid."""

    def __init__(
        self,
        grid: Grid,
        job: codec.Job,
        federation: Federation,
        timeout: float,
        stop: Callable[[], bool] | None = None,
        protocol: Protocol | None = None,
    ) -> None:
        self.grid, self.job, self.federation, self.timeout, self.stop = grid, job, federation, timeout, stop
        self.protocol = protocol
        self.extra: Callable[[int], Mapping[str, Any]] | None = None
        """Partition → records added to its task (the node-side plan and release under distributed or local DP)."""

    def _task(self, p: int, encode: codec.TaskEncoder) -> Any:
        content = encode(self.federation.ranges[p])
        if self.extra is not None:
            for name, record in self.extra(p).items():
                content[name] = record
        return content

    def __call__(self, round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        fed = self.federation
        encode = codec.TaskEncoder(self.job, round, codec.broadcast_record(broadcast))
        group = str(round)
        messages = [
            FlowerMessage(self._task(p, encode), node, MessageType.TRAIN, group_id=group)
            for p, node in sorted(fed.nodes.items())
        ]
        by_node = {m.metadata.src_node_id: m for m in exchange(self.grid, messages, self.timeout, self.stop)}
        expect = (round, codec.broadcast_digest(round, broadcast))
        return [self._reply(p, by_node, round, expect) for p in range(fed.num_partitions)]

    def max_units(self, p: int, round: int) -> int:
        """The most units partition p can have in ``round``: its users in the round's cohort."""
        ids = self.federation.ranges[p]
        if self.protocol is None:
            return len(ids)
        return self.protocol.planned_units(round, [ids])

    def _reply(self, p: int, by_node: Mapping[int, FlowerMessage], round: int, expect: tuple[int, str]) -> ClientReply:
        label, max_units = f"partition-{p}", self.max_units(p, round)
        node = self.federation.nodes.get(p)
        if node is None:
            return ClientReply(label, max_units, None, "no node holds this partition (none answered discovery)")
        reply = by_node.get(node)
        if reply is None:
            return ClientReply(label, max_units, None, f"no reply within {self.timeout:g} s")
        if reply.has_error():
            return ClientReply(label, max_units, None, f"client error: {reply.error.reason}")
        try:
            message, rebuilt = codec.decode_reply_symmetric(reply.content, expect)
            return ClientReply(label, max_units, message, symmetric_by_construction=rebuilt)
        except codec.MalformedReply as e:
            return ClientReply(label, max_units, None, f"malformed reply: {e}")


def run_on_grid(
    grid: Grid,
    job: codec.Job,
    num_units: int,
    protocol: Protocol,
    privatizer: Privatizer,
    options: Any,
    *,
    device: torch.device | str = "cpu",
    expected_nodes: int | None = None,
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    on_discovery: Callable[[Federation], None] | None = None,
    progress: bool = True,
    stop: Callable[[], bool] | None = None,
    checkpoint: Any = None,
) -> tuple[Any, list[RoundRecord]]:
    """Discover the nodes on ``grid``, then run every round of ``protocol`` (``job`` is what the
    nodes rebuild it from) over ``num_units`` units through them.

    ``stop()`` true makes waiting for replies give up (the caller's engine has died).
    """
    start = time.perf_counter()
    mapping = parse_node_partitions(getattr(options, "node_partitions", ""))
    with phase(
        f"flower: waiting for {expected_nodes or options.nodes} nodes to join (node start-up and discovery)", progress
    ):
        if mapping:
            nodes, num = assigned(grid, mapping, options.round_timeout, stop)
        else:
            nodes, num = discover(grid, job, options.round_timeout, expected_nodes, stop)
    federation = Federation(nodes, unit_ranges(num_units, num, options.users_per_node), time.perf_counter() - start)
    from fedpers.runtime.flower.policy import active_policy, check_partitions

    if (policy := active_policy()) is not None:
        check_partitions(
            policy, {p: len(r) for p, r in enumerate(federation.ranges)}
        )  # no partition below the policy's min-units
    if on_discovery is not None:
        on_discovery(federation)
    gather = GridGather(grid, job, federation, options.round_timeout, stop, protocol)
    from fedpers.privacy.distributed import NodeSidePrivatizer

    if isinstance(privatizer, NodeSidePrivatizer):  # distributed or local DP: the nodes add the noise
        from fedpers.config import DpModel
        from fedpers.runtime.flower.nodeside import NodeSideGather, task_record
        from fedpers.runtime.flower.secaggplus import SecAggRounds

        if federation.num_partitions != privatizer.plan.nodes:  # the noise shares are sized for plan.nodes
            raise ValueError(
                f"nodes={privatizer.plan.nodes} under dp_model {privatizer.plan.model.value}, but the federation has "
                f"{federation.num_partitions} partitions; set nodes to the number of SuperNodes (nothing was released)"
            )
        if checkpoint is not None and checkpoint.resume is not None:  # the nodes derive each round's state
            raise ValueError(  # from every release since round 0, which a resumed run's new session never sent them
                f"dp_model {privatizer.plan.model.value} on Flower cannot resume a run: each node derives the broadcast "
                "from the run's releases since round 0 (start the run again; nothing was released)"
            )
        secure = (
            SecAggRounds(gather, privatizer.plan, exchange) if privatizer.plan.model is DpModel.DISTRIBUTED else None
        )
        nodes_gather = NodeSideGather(gather, protocol, privatizer, num_units, device, secure)
        gather.extra = lambda p: task_record(privatizer, p, secure, nodes_gather.released)
        return drive(
            protocol,
            nodes_gather,
            privatizer,
            min_fraction=options.min_fraction,
            on_round=nodes_gather.on_round(on_round),
            progress=progress,
            device=device,
            checkpoint=checkpoint,
        )
    return drive(
        protocol,
        gather,
        privatizer,
        min_fraction=options.min_fraction,
        on_round=on_round,
        progress=progress,
        device=device,
        checkpoint=checkpoint,
    )
