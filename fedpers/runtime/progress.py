"""Progress lines on stderr for the phases of a run that have no round bar: evaluation and its
baselines, Flower's start-up. A phase is announced before its work starts (so a long silence
always has a name) and, when it took a while, closed with its duration."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

QUIET_BELOW_S = 1.0
"""A phase shorter than this is not closed with a line of its own (its announcement stands)."""


def say(line: str, enabled: bool = True) -> None:
    """One progress line on stderr (flushed at once, so it shows before the work it announces)."""
    if enabled:
        print(line, file=sys.stderr, flush=True)


@contextmanager
def phase(what: str, enabled: bool = True) -> Iterator[None]:
    """``what …`` on stderr before the block, ``what: done in X s`` after it (if ≥ 1 s)."""
    say(f"{what} …", enabled)
    start = time.perf_counter()
    yield
    took = time.perf_counter() - start
    if took >= QUIET_BELOW_S:
        say(f"{what}: done in {took:.1f} s", enabled)
