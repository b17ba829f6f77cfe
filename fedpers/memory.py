"""How much memory this process may use, for refusing runs that cannot fit before they start."""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical pages × page size, else 0 (unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def check_fits(algorithm: str, need: dict[str, int], advice: str) -> list[str]:
    """The plan line for ``need`` (bytes per part); ValueError if the total exceeds what is available.

    Called by an experiment's ``plan`` (printed before the run) and by its ``protocol`` (so the
    Python API refuses too), before any data is generated or any noise drawn.
    """
    total = sum(need.values())
    parts = ", ".join(f"{k} {human(v)}" for k, v in need.items())
    limit = available_bytes()
    if limit > 0 and total > limit:
        raise ValueError(
            f"{algorithm} needs about {human(total)} of memory ({parts}) but {human(limit)} is available; {advice}"
        )
    return [f"{algorithm}: memory needed about {human(total)} ({parts}); available {human(limit)}"]


def reuse_freed_memory() -> bool:
    """Ask glibc's malloc to keep large freed blocks for reuse instead of unmapping them.

    By default glibc serves every allocation above 32 MiB with a fresh ``mmap`` and unmaps it on
    free, so each chunk's tensors (65–130 MB at 4,096 users, d = 100) are faulted in and zeroed
    by the kernel page by page, every chunk of every pass. With mmap off and trimming only above
    2 GiB of free heap, a chunk reuses the last one's pages; the cost is that the process keeps
    its high-water mark of heap (both measured in docs/benchmarks.md). Called by the ``fedpers`` command for the commands that run
    work (a library caller keeps its own policy); ``FEDPERS_MALLOC=system`` leaves glibc's.
    Returns whether the setting took (False off glibc)."""
    if os.environ.get("FEDPERS_MALLOC", "") == "system":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
