"""The data summary a run prints before any work and records in its result (``data`` block).

Descriptive counts of the input held by the operator — users, samples, the features used by
name, users capped or left without data, rows dropped per reason — so data is never changed
silently. They are computed from the raw data: not a differentially private release, and
labelled so wherever they appear.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

ROBUST_FENCE = 10.0
"""k of the robust label range [q₁ − k·IQR, q₃ + k·IQR] (Tukey's far-out fence is k = 3; 10 flags
only values no real label scale explains, e.g. a 1e9 among labels of order 1)."""


def robust_range(values: np.ndarray, fence: float = ROBUST_FENCE) -> tuple[float, float]:
    """[q₁ − k·IQR, q₃ + k·IQR] of ``values`` ((−inf, inf) for none)."""
    if values.size == 0:
        return -math.inf, math.inf
    q1, q3 = np.quantile(values, [0.25, 0.75])
    return float(q1 - fence * (q3 - q1)), float(q3 + fence * (q3 - q1))


NOTE = "descriptive counts of the input file held by the operator, not a differentially private release"


def lines(summary: Mapping[str, Any]) -> list[str]:
    """The summary as the lines a run prints before any work."""
    skip = ("note", "rows_dropped", "samples_zeroed")
    head = ", ".join(
        f"{k.replace('_', ' ')} {', '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in summary.items()
        if k not in skip and not isinstance(v, dict)
    )
    out = [f"data (operator-side counts, not a DP release): {head}"]
    for key, what in (("rows_dropped", "rows dropped"), ("samples_zeroed", "samples zeroed")):
        out += [f"  {what}: {n} ({reason})" for reason, n in (summary.get(key) or {}).items()]
    return out
