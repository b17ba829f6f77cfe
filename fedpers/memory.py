"""How much memory this process may use, for refusing runs that cannot fit before they start."""

from __future__ import annotations

import os


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
