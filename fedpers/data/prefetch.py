"""A :class:`UnitSource` of synthetic units drawn on demand, the next chunk drawn in the background.

What it draws is its subclass's :meth:`PrefetchSource.take` (AltMin's users:
:class:`fedpers.experiments.altmin.AltMinSource`); this module holds how: chunks cut at
generation-block boundaries so that no block is drawn twice in a pass, and one chunk made ahead
by a background thread while the caller computes on the current one.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fedpers.data import synthetic
from fedpers.data.units import UnitSource

Tensor = torch.Tensor

PREFETCH = True
"""Synthetic chunks on the CPU are made one ahead, from a background thread, while the caller
works on the current one (generation overlaps compute; see :class:`PrefetchSource`)."""
_PREFETCHER: list[ThreadPoolExecutor] = []
os.register_at_fork(after_in_child=_PREFETCHER.clear)  # a forked child has none of the parent's threads

Job = tuple[Tensor, tuple[int, int] | None, bool]
"""A chunk to draw: its ids, the sample range [a, b) (None: every sample), keep_partial_blocks."""


def _prefetcher() -> ThreadPoolExecutor:
    if not _PREFETCHER:
        _PREFETCHER.append(ThreadPoolExecutor(1, thread_name_prefix="fedpers-prefetch"))
    return _PREFETCHER[0]


class PrefetchSource(UnitSource, abc.ABC):
    """Units made on demand: a round's chunks hold only the units and sample halves it reads
    (``Protocol.units_needed``), cut at generation-block boundaries so no block is drawn twice
    in a pass.

    On the CPU the next chunk is generated while the caller computes on the current one: a
    background thread hands its blocks to the shared pool of single-threaded workers (as many
    as the caller's torch threads), the same bits as any other way (blocks are keyed by
    (seed, block)). The pool's workers take generation and the caller's statistics in turn,
    so both cores stay busy when generation dominates, as in a float64 host run (measured in
    docs/benchmarks.md, "Synthetic users"). torch keeps its thread count per thread (OpenMP's
    per-thread setting), so the background thread setting its own to 1 around the pool does
    not change the caller's. One chunk ahead: memory grows by one chunk."""

    def __init__(self, num_units: int, samples: tuple[int, int] | None, device: torch.device | str) -> None:
        self.samples = samples
        super().__init__(num_units, lambda a, b: self.take(torch.arange(a, b), self.samples), device)

    @abc.abstractmethod
    def take(
        self,
        ids: Tensor,
        samples: tuple[int, int] | None,
        keep_partial_blocks: bool = True,
        workers: int | None = None,
    ) -> dict[str, Tensor]:
        """The units ``ids`` with samples [a, b) (None: all); ``keep_partial_blocks`` False: keep
        no partly used block for later callers; ``workers``: threads drawing blocks."""

    def _ahead(self, jobs: list[Job]) -> Iterator[dict[str, Tensor]]:
        """The chunks ``jobs`` (ids, samples, keep_partial_blocks) in order, the next one made
        in the background while the caller holds the current one (CPU; elsewhere in order)."""
        if not PREFETCH or len(jobs) < 2 or self.device.type != "cpu":
            for ids, samples, keep in jobs:
                yield self.take(ids, samples, keep)
            return
        pending: Future[dict[str, Tensor]] | None = None
        workers = torch.get_num_threads()
        try:
            for i, (ids, samples, keep) in enumerate(jobs):
                current = self.take(ids, samples, keep) if pending is None else pending.result()
                pending = None
                if i + 1 < len(jobs):
                    nxt = jobs[i + 1]
                    pending = _prefetcher().submit(self.take, nxt[0], nxt[1], nxt[2], workers)
                yield current
        finally:  # a caller that stops early leaves no draw running behind it (block cache, pass counts)
            if pending is not None and not pending.cancel():
                pending.exception()

    def chunks(self, chunk_size: int) -> Iterator[dict[str, Tensor]]:
        return self._ahead(
            [
                (torch.arange(start, min(start + chunk_size, self.num_units)), self.samples, True)
                for start in range(0, self.num_units, chunk_size)
            ]
        )

    def needed_chunks(
        self, chunk_size: int, ids: Tensor | None, samples: tuple[int, int] | None
    ) -> Iterator[dict[str, Tensor]]:
        if ids is None:
            return self._ahead(
                [
                    (torch.arange(start, min(start + chunk_size, self.num_units)), samples, True)
                    for start in range(0, self.num_units, chunk_size)
                ]
            )
        ids = ids.to(torch.int64).cpu().sort().values
        # chunk ends on block boundaries: ~chunk_size users each, a block never split
        ends = torch.searchsorted(ids, torch.arange(0, self.num_units + synthetic.BLOCK, synthetic.BLOCK), right=False)
        jobs: list[Job] = []
        start = 0
        while start < ids.numel():
            stop = int(ends[torch.searchsorted(ends, torch.tensor(start + chunk_size), right=True) - 1])
            if stop <= start:  # one block holds more than chunk_size of the ids
                stop = int(ends[torch.searchsorted(ends, torch.tensor(start), right=True)])
            jobs.append((ids[start:stop], samples, False))  # each block once per pass
            start = stop
        return self._ahead(jobs)
