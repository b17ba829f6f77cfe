"""The round loop shared by every runtime: broadcast, gather, verify, sum, privatise.

A runtime supplies only ``gather``: how a broadcast reaches the clients and how their
messages come back. Verification, dropping, the minimum-participation rule, the call
to ``server_update`` and the per-round checkpoint live here, so the local and Flower
runtimes cannot drift apart (and both resume the same way).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message, Protocol, verify_message, zero_message
from fedpers.runtime.checkpoint import Checkpoint, Checkpointer

Tensor = torch.Tensor


@dataclass
class ClientReply:
    """One client's answer in a round: a message, or the error it raised / timed out with."""

    client: str
    max_units: int
    message: Message | None = None
    error: str = ""
    aggregate: bool = False
    """The message is already the noisy sum of every node (distributed or local DP): the server
    cannot check a unit bound on it, so only names, shapes, dtype, finiteness and count are checked. Its
    count is the units the public plan gives the summed nodes, and it carries no zeroed count (the round
    records ``units_zeroed`` as None: not released)."""
    symmetric_by_construction: frozenset[str] = frozenset()
    """Statistics the runtime rebuilt from one triangle of what the client sent: symmetric whatever
    it sent, so verification skips only their symmetry check (see :func:`verify_message`)."""


Gather = Callable[[int, Mapping[str, Tensor]], Sequence[ClientReply]]


@dataclass
class RoundRecord:
    round: int
    clients: int
    accepted: int
    units: int
    dropped: dict[str, str] = field(default_factory=dict)
    zeroed: int | None = 0
    """Units whose non-finite contribution entered as 0. None under distributed and local DP: the nodes keep
    that count with their operators (it depends on the data) and no reply carries it."""
    diagnostics: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "clients": self.clients,
            "clients_accepted": self.accepted,
            "units": self.units,
            "units_zeroed": self.zeroed,
            "dropped": self.dropped,
            **self.diagnostics,
            **self.metrics,
            "seconds": self.seconds,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RoundRecord:
        known = {"round", "clients", "clients_accepted", "units", "units_zeroed", "dropped", "seconds"}
        return RoundRecord(
            int(d["round"]),
            int(d["clients"]),
            int(d["clients_accepted"]),
            int(d["units"]),
            dict(d.get("dropped", {})),
            None if d.get("units_zeroed", 0) is None else int(d.get("units_zeroed", 0)),
            {k: v for k, v in d.items() if k not in known},
            {},
            float(d.get("seconds", 0.0)),
        )


def _placed(state: Any, device: torch.device) -> Any:
    """A resumed state with its tensors on the server's ``device`` (a checkpoint is read onto the run's
    device; the local runtime's server is on the host)."""
    if isinstance(state, Tensor):
        return state if state.device.type == device.type else state.to(device)
    if isinstance(state, dict):
        return {k: _placed(v, device) for k, v in state.items()}
    return state


class RoundFailed(RuntimeError):
    """Too few clients answered acceptably; the run stops and keeps what it has."""


def drive(
    protocol: Protocol,
    gather: Gather,
    privatizer: Privatizer,
    *,
    min_fraction: float = 1.0,
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    progress: bool = True,
    device: torch.device | str = "cpu",
    checkpoint: Checkpointer | None = None,
) -> tuple[Any, list[RoundRecord]]:
    """Run every round of ``protocol``; returns the final server state and one record per round.

    With ``checkpoint``, a checkpoint is saved after every round, before ``on_round`` publishes
    anything of it; ``checkpoint.resume`` (a loaded checkpoint) continues from its round with
    its state and the privatizer's generators; the records returned are those of the rounds
    run in this call (``on_round`` published the earlier ones).
    """
    if not 0 < min_fraction <= 1:
        raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction}")
    resume = checkpoint.resume if checkpoint is not None else None
    if resume is not None:
        state, first = _placed(resume.state, torch.device(device)), resume.next_round  # where this server keeps it
        privatizer.load_state_dict(resume.privatizer)
    else:
        state, first = protocol.server_start(protocol.initial_state(), privatizer), 0
    records: list[RoundRecord] = []
    bar = tqdm(
        range(first, protocol.num_rounds),
        desc=protocol.name,
        unit="round",
        disable=not progress,
        leave=False,
        initial=first,
        total=protocol.num_rounds,
    )
    for r in bar:
        start = time.perf_counter()
        broadcast = protocol.broadcast(state, r)
        specs = protocol.stat_specs(r)
        replies = gather(r, broadcast)
        total = zero_message(specs, protocol.dtype, device)
        dropped: dict[str, str] = {}
        for reply in replies:
            if reply.message is None:
                dropped[reply.client] = reply.error or "no reply"
                continue
            msg = Message(
                {k: v.to(device=device) for k, v in reply.message.stats.items()},
                reply.message.count,
                reply.message.zeroed,
            )
            checked = (
                tuple(dataclasses.replace(s, per_unit_bound=math.inf) for s in specs) if reply.aggregate else specs
            )
            verdict = verify_message(msg, checked, reply.max_units, protocol.dtype, reply.symmetric_by_construction)
            if not verdict.accepted:
                dropped[reply.client] = verdict.reason
                continue
            if reply.aggregate and len(replies) == 1:  # the runtime's whole sum: handed on as it arrived, so a
                total = msg  # NodeSidePrivatizer knows each release by the tensor it registered (never by value)
            else:
                total.add_(msg)  # in place: total owns its tensors (zero_message), one allocation per round
        accepted = len(replies) - len(dropped)
        if not replies or accepted < min_fraction * len(replies):
            raise RoundFailed(
                f"round {r}: {accepted} of {len(replies)} clients answered acceptably, "
                f"below min_fraction={min_fraction}; dropped: {dropped}"
            )
        state, diagnostics = protocol.server_update(r, state, total, privatizer)
        zeroed = None if any(reply.aggregate for reply in replies) else total.zeroed  # node-side: not released
        record = RoundRecord(r, len(replies), accepted, total.count, dropped, zeroed, dict(diagnostics))
        record.seconds = time.perf_counter() - start
        records.append(record)
        if checkpoint is not None:
            checkpoint.save(Checkpoint(r + 1, state, [record.to_dict()], privatizer.state_dict()))
        if on_round is not None:
            on_round(record, state)
        if record.metrics:
            bar.set_postfix({k: f"{v:.3g}" for k, v in list(record.metrics.items())[:2]})
    bar.close()
    return state, records
