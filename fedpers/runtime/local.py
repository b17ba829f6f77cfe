"""The local runtime: every unit batched on one device, in memory-bounded chunks.

Units come either as tensors already in memory or as a :class:`UnitSource` that produces
any range of units on demand (synthetic users from (seed, id), rows of a file), so a run
over a million users never holds more than one chunk of their data.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch

from fedpers.privacy import Privatizer
from fedpers.protocols.base import Protocol, Units, client_message
from fedpers.runtime.checkpoint import Checkpointer
from fedpers.runtime.driver import ClientReply, RoundRecord, drive

Tensor = torch.Tensor


class UnitSource:
    """Units 0..n−1 produced chunk by chunk by ``load(start, stop)``; nothing is kept between chunks."""

    def __init__(self, num_units: int, load: Callable[[int, int], Units], device: torch.device | str = "cpu") -> None:
        self.num_units, self.load, self.device = int(num_units), load, torch.device(device)

    @staticmethod
    def of(units: "Units | UnitSource") -> "UnitSource":
        """A source over tensors already in memory (views, no copies), or the source itself."""
        if isinstance(units, UnitSource):
            return units
        return UnitSource(num_units(units), lambda start, stop: slice_units(units, start, stop), units["ids"].device)

    def slice(self, start: int, stop: int) -> dict[str, Tensor]:
        return dict(self.load(start, min(stop, self.num_units)))

    def chunks(self, chunk_size: int) -> Iterator[dict[str, Tensor]]:
        for start in range(0, self.num_units, chunk_size):
            yield self.slice(start, start + chunk_size)

    def needed_chunks(self, chunk_size: int, ids: Tensor | None, samples: tuple[int, int] | None) -> Iterator[dict[str, Tensor]]:
        """Chunks holding at least the units ``ids`` (None: all) with samples [a, b) (see
        ``Protocol.units_needed``); this one loads everything (the protocol filters), a source
        that makes units on demand overrides it to make only those."""
        return self.chunks(chunk_size)


def slice_units(units: Units, start: int, stop: int) -> dict[str, Tensor]:
    return {k: v[start:stop] for k, v in units.items()}


def num_units(units: Units) -> int:
    return int(units["ids"].shape[0])


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
        for part_units in source.needed_chunks(chunk_size, *protocol.units_needed(round, broadcast)):
            part = client_message(protocol, round, broadcast, part_units)
            message = part if message is None else message + part
        return [ClientReply("local", n, message)]

    return drive(protocol, gather, privatizer, on_round=on_round, progress=progress, device=source.device, checkpoint=checkpoint)
