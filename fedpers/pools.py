"""Thread pools kept for the process, one per size: torch ops release the GIL, so independent
blocks (synthetic users, per-user statistics, small batched LAPACK calls) run on all cores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[int, ThreadPoolExecutor] = {}


def pool(workers: int) -> ThreadPoolExecutor:
    """The process's thread pool of ``workers`` threads (made once)."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="fedpers")
    return _POOLS[workers]
