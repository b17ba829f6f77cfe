"""The round loop shared by every runtime: broadcast, gather, verify, sum, privatise.

A runtime supplies only ``gather``: how a broadcast reaches the clients and how their
messages come back. Verification, dropping, the minimum-participation rule and the call
to ``server_update`` live here, so the local and Flower runtimes cannot drift apart.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message, Protocol, verify_message, zero_message

Tensor = torch.Tensor


@dataclass
class ClientReply:
    """One client's answer in a round: a message, or the error it raised / timed out with."""

    client: str
    max_units: int
    message: Message | None = None
    error: str = ""


Gather = Callable[[int, Mapping[str, Tensor]], Sequence[ClientReply]]


@dataclass
class RoundRecord:
    round: int
    clients: int
    accepted: int
    units: int
    dropped: dict[str, str] = field(default_factory=dict)
    zeroed: int = 0
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
) -> tuple[Any, list[RoundRecord]]:
    """Run every round of ``protocol``; returns the final server state and one record per round."""
    if not 0 < min_fraction <= 1:
        raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction}")
    state = protocol.initial_state()
    records: list[RoundRecord] = []
    bar = tqdm(range(protocol.num_rounds), desc=protocol.name, unit="round", disable=not progress, leave=False)
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
            msg = Message({k: v.to(device=device) for k, v in reply.message.stats.items()}, reply.message.count, reply.message.zeroed)
            verdict = verify_message(msg, specs, reply.max_units, protocol.dtype)
            if not verdict.accepted:
                dropped[reply.client] = verdict.reason
                continue
            total = total + msg
        accepted = len(replies) - len(dropped)
        if not replies or accepted < min_fraction * len(replies):
            raise RoundFailed(
                f"round {r}: {accepted} of {len(replies)} clients answered acceptably, "
                f"below min_fraction={min_fraction}; dropped: {dropped}"
            )
        state, diagnostics = protocol.server_update(r, state, total, privatizer)
        record = RoundRecord(r, len(replies), accepted, total.count, dropped, total.zeroed, dict(diagnostics))
        record.seconds = time.perf_counter() - start
        if on_round is not None:
            on_round(record, state)
        records.append(record)
        if record.metrics:
            bar.set_postfix({k: f"{v:.3g}" for k, v in list(record.metrics.items())[:2]})
    bar.close()
    return state, records
