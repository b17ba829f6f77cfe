"""The local runtime: every unit batched on one device, in memory-bounded chunks.

Units come either as tensors already in memory or as a :class:`~fedpers.data.units.UnitSource`
that produces any range of units on demand (synthetic users from (seed, id), rows of a file),
so a run over a million users never holds more than one chunk of their data.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from fedpers.data.units import UnitSource
from fedpers.privacy import Privatizer
from fedpers.protocols.base import Protocol, Units, client_message
from fedpers.runtime.checkpoint import Checkpointer
from fedpers.runtime.driver import ClientReply, RoundRecord, drive

Tensor = torch.Tensor


def run_local(
    protocol: Protocol,
    units: Units | UnitSource,
    privatizer: Privatizer,
    *,
    chunk_size: int = 4096,
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    progress: bool = True,
    checkpoint: Checkpointer | None = None,
) -> tuple[Any, list[RoundRecord]]:
    """Run ``protocol`` over all ``units`` as one client, computing statistics ``chunk_size`` units at a time."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    source = UnitSource.of(units)
    n = source.num_units

    def gather(round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        message = None
        for part_units in source.chunks(chunk_size):
            part = client_message(protocol, round, broadcast, part_units)
            message = part if message is None else message + part
        return [ClientReply("local", n, message)]

    return drive(protocol, gather, privatizer, on_round=on_round, progress=progress, device=source.device, checkpoint=checkpoint)
