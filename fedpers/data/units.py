"""Units as data: the tensors a client holds, and :class:`UnitSource`, which produces any range of them.

A unit's data is a dict of tensors with a leading unit dimension, including ``"ids"`` (global
unit ids). A :class:`UnitSource` produces units ``start..stop-1`` on demand (synthetic users
from (seed, id), rows of a file), so a run over a million users never holds more than one
chunk of their data. The runtimes consume sources; the experiments and data loaders build them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from fedpers.devices import to_device

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
        ``Protocol.units_needed``); a source that makes units on demand overrides it to make only those.

        On the CPU this one loads every chunk and the protocol selects its units (a chunk's rows
        are what they always were). Elsewhere each chunk [c·size, (c + 1)·size) holds only the
        units of ``ids`` in it (a slice, or rows gathered by an index copied without waiting;
        chunks with none are skipped), so a client on a GPU never selects rows by reading a mask
        (:func:`fedpers.protocols.base.all_take_part`); the rows, and so the sums, are the same."""
        if ids is None or self.device.type == "cpu":
            return self.chunks(chunk_size)
        return self._selected(chunk_size, ids.to(torch.int64).cpu().sort().values)

    def _selected(self, chunk_size: int, ids: Tensor) -> Iterator[dict[str, Tensor]]:
        """Every chunk's units of the sorted host ``ids``: a contiguous run is loaded as a slice."""
        for start in range(0, self.num_units, chunk_size):
            stop = min(start + chunk_size, self.num_units)
            lo, hi = (int(i) for i in torch.searchsorted(ids, torch.tensor([start, stop])))
            if lo == hi:
                continue
            first, last = int(ids[lo]), int(ids[hi - 1])
            if last - first == hi - lo - 1:  # consecutive ids: load just them
                yield self.slice(first, last + 1)
                continue
            units = self.slice(start, stop)
            rows = ids[lo:hi] - start
            on_device = to_device(rows, self.device)
            yield {k: v[on_device if v.device.type != "cpu" else rows] for k, v in units.items()}


def slice_units(units: Units, start: int, stop: int) -> dict[str, Tensor]:
    """Units ``start..stop-1`` of tensors in memory (views)."""
    return {k: v[start:stop] for k, v in units.items()}


def num_units(units: Units) -> int:
    """How many units ``units`` holds (the length of its ``"ids"``)."""
    return int(units["ids"].shape[0])
