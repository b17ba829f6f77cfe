"""Units as data: the tensors a client holds, and :class:`UnitSource`, which produces any range of them.

A unit's data is a dict of tensors with a leading unit dimension, including ``"ids"`` (global
unit ids). A :class:`UnitSource` produces units ``start..stop-1`` on demand (synthetic users
from (seed, id), rows of a file), so a run over a million users never holds more than one
chunk of their data. The runtimes consume sources; the experiments and data loaders build them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

Tensor = torch.Tensor
Units = Mapping[str, Tensor]
"""A client's units: tensors with a leading unit dimension, including ``"ids"`` (global unit ids)."""


class UnitSource:
    """Units 0..n−1 produced chunk by chunk by ``load(start, stop)``; nothing is kept between chunks."""

    def __init__(self, num_units: int, load: Callable[[int, int], Units], device: torch.device | str = "cpu") -> None:
        self.num_units, self.load, self.device = int(num_units), load, torch.device(device)

    @staticmethod
    def of(units: Units | UnitSource) -> UnitSource:
        """A source over tensors already in memory (views, no copies), or the source itself."""
        if isinstance(units, UnitSource):
            return units
        return UnitSource(num_units(units), lambda start, stop: slice_units(units, start, stop), units["ids"].device)

    def slice(self, start: int, stop: int) -> dict[str, Tensor]:
        """Units ``start..min(stop, n)-1``."""
        return dict(self.load(start, min(stop, self.num_units)))

    def chunks(self, chunk_size: int) -> Iterator[dict[str, Tensor]]:
        """Every unit, ``chunk_size`` at a time."""
        for start in range(0, self.num_units, chunk_size):
            yield self.slice(start, start + chunk_size)

    def needed_chunks(
        self, chunk_size: int, ids: Tensor | None, samples: tuple[int, int] | None
    ) -> Iterator[dict[str, Tensor]]:
        """Chunks holding at least the units ``ids`` (None: all) with samples [a, b) (see
        ``Protocol.units_needed``); this one loads everything (the protocol filters), a source
        that makes units on demand overrides it to make only those."""
        return self.chunks(chunk_size)


def slice_units(units: Units, start: int, stop: int) -> dict[str, Tensor]:
    """Units ``start..stop-1`` of tensors in memory (views)."""
    return {k: v[start:stop] for k, v in units.items()}


def num_units(units: Units) -> int:
    """How many units ``units`` holds (the length of its ``"ids"``)."""
    return int(units["ids"].shape[0])
