"""`fedpers compare RUN_DIR...`: runs side by side — privacy spent, noise, primary metrics, time.

Runs of different algorithms compare too: the table shows one block per algorithm with the
metrics its runs share; ``--json`` keeps the union of the metric columns. A killed run is shown with the releases it made and its last
round's metrics, marked incomplete.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIXED = ("run", "algorithm", "runtime", "status", "epsilon", "delta", "noise_multiplier", "seconds")
NOT_METRICS = {
    "seconds",
    "epsilon",
    "delta",
    "noise_multiplier",
    "round",
    "clients",
    "clients_accepted",
    "units",
    "units_zeroed",
}


def run_row(path: str | Path) -> dict[str, Any]:
    """One run's row: identity, privacy spent (from its ledger), its top-level numeric metrics."""
    from fedpers.commands.privacy_report import privacy_summary
    from fedpers.results.rundir import read_run

    run = read_run(path)  # refuses a directory that is not a run
    result = run.get("result", {})
    priv = privacy_summary(path)
    row: dict[str, Any] = {
        "run": Path(path).name or str(path),
        "algorithm": run["config"].get("algorithm"),
        "runtime": result.get("runtime", run["config"].get("runtime", {}).get("runtime", "?")),
        "status": "completed" if run["complete"] else f"incomplete ({len(run['rounds'])} rounds)",
        "epsilon": priv["epsilon"],
        "delta": priv["delta"],
        "noise_multiplier": result.get("noise_multiplier", result.get("privacy", {}).get("noise_multiplier")),
        "seconds": result.get("seconds"),
    }
    metrics = {k: v for k, v in result.items() if _number(v) and k not in NOT_METRICS}
    if not run["complete"] and run["rounds"]:
        metrics = {k: v for k, v in run["rounds"][-1].items() if _number(v) and k not in NOT_METRICS}
    row.update(metrics)
    return row


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def compare(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(rows, metric columns, primary metrics): each algorithm's primary metric first, then the rest."""
    from fedpers.experiments import ALGORITHMS, experiment

    if not paths:
        raise ValueError("compare: give at least one run directory")
    rows = [run_row(p) for p in paths]
    names = [r["run"] for r in rows]
    if len(set(names)) < len(names):  # same directory name under different parents: label by path
        for row, p in zip(rows, paths):
            row["run"] = str(p)
    primary = []
    for row in rows:
        name = row["algorithm"]
        if name in ALGORITHMS:
            key = experiment(name).primary_metric
            if key in row and key not in primary:
                primary.append(key)
    others = [k for row in rows for k in row if k not in FIXED and k not in primary]
    return rows, primary + list(dict.fromkeys(others)), primary


def figure_metrics(rows: list[dict[str, Any]], metrics: list[str], primary: list[str]) -> list[str]:
    """The panels worth drawing: every primary metric, and any other that at least two runs share."""
    if len(rows) < 2:
        return metrics
    return [m for m in metrics if m in primary or sum(_number(r.get(m)) for r in rows) >= 2]


def format_table(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    """The runs as a table. Runs of several algorithms are shown as one block per algorithm,
    each with only the metrics its runs have (a union over algorithms is mostly blanks: 31
    columns for altmin beside dpals); within a block a metric no run has is left out."""
    algorithms = list(dict.fromkeys(str(r.get("algorithm")) for r in rows))
    if len(algorithms) > 1:
        blocks = []
        for name in algorithms:
            block = [r for r in rows if str(r.get("algorithm")) == name]
            blocks.append(f"{name} ({len(block)} run{'s' if len(block) > 1 else ''}):\n" + _block(block, metrics))
        return "\n\n".join(blocks)
    return _block(rows, metrics)


def _block(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    metrics = [m for m in metrics if any(r.get(m) is not None for r in rows)]
    columns = list(FIXED) + metrics
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths)))]
    for r in cells:
        lines.append("  ".join(v.ljust(w) if i < 4 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)
