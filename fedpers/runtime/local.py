"""The local runtime: every unit batched on one device, in memory-bounded chunks."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from fedpers.privacy import Privatizer
from fedpers.protocols.base import Protocol, Units, client_message
from fedpers.runtime.driver import ClientReply, RoundRecord, drive

Tensor = torch.Tensor


def slice_units(units: Units, start: int, stop: int) -> dict[str, Tensor]:
    return {k: v[start:stop] for k, v in units.items()}


def num_units(units: Units) -> int:
    return int(units["ids"].shape[0])


def run_local(
    protocol: Protocol,
    units: Units,
    privatizer: Privatizer,
    *,
    chunk_size: int = 4096,
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    progress: bool = True,
) -> tuple[Any, list[RoundRecord]]:
    """Run ``protocol`` over all ``units`` as one client, computing statistics ``chunk_size`` units at a time."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = num_units(units)
    device = units["ids"].device

    def gather(round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        message = None
        for start in range(0, n, chunk_size):
            part = client_message(protocol, round, broadcast, slice_units(units, start, start + chunk_size))
            message = part if message is None else message + part
        return [ClientReply("local", n, message)]

    return drive(protocol, gather, privatizer, on_round=on_round, progress=progress, device=device)
