"""Summaries of result rows (mean and standard error per series and x); beside ``results.py``, below ``experiments/``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def number(v: Any) -> float:
    """A table cell as a float: numbers as themselves, "inf"/"-inf"/"nan" strings parsed, anything else nan."""
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float(v)
    return float(v) if isinstance(v, (int, float)) else math.nan


def summarise(
    rows: list[dict[str, Any]], series: str, x: str, metric: str
) -> dict[Any, list[tuple[float, float, float]]]:
    """series value -> [(x, mean, standard error)] sorted by x, over the rows' finite ``metric`` values."""
    groups: dict[tuple[Any, Any], list[float]] = {}
    for row in rows:
        v = number(row.get(metric))
        if math.isfinite(v):
            groups.setdefault((row[series], row[x]), []).append(v)
    out: dict[Any, list[tuple[float, float, float]]] = {}
    for (s, xv), vals in groups.items():
        arr = np.asarray(vals)
        se = float(arr.std(ddof=1) / math.sqrt(len(arr))) if len(arr) > 1 else 0.0
        out.setdefault(s, []).append((number(xv), float(arr.mean()), se))
    return {s: sorted(v) for s, v in out.items()}
