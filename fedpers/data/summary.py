"""The data summary a run prints before any work and records in its result (``data`` block).

Descriptive counts of the input held by the operator — users, samples, the features used by
name, users capped or left without data, rows dropped per reason — so data is never changed
silently. They are computed from the raw data: not a differentially private release, and
labelled so wherever they appear.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
