"""`fedpers compare RUN_DIR...`: runs side by side — privacy spent, noise, primary metrics, time.

Runs of different algorithms compare too: the table shows one block per algorithm with the
metrics its runs share; ``--json`` keeps the union of the metric columns. A killed run is shown with the releases it made and its last
round's metrics, marked incomplete.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIXED = ("run", "algorithm", "runtime", "status", "epsilon", "delta", "noise_multiplier", "seconds")
NOT_METRICS = {  # bookkeeping of a round record, not metrics (a killed run shows its last round's)
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
    """One run's row: identity and :func:`fedpers.commands.summary.compare_row` (privacy spent,
    noise, time, metrics); a killed run shows what its ledger's releases so far spent and its
    last round's metrics."""
    from fedpers.commands import summary
    from fedpers.commands.privacy_report import privacy_summary
    from fedpers.results.run_result import RunResult
    from fedpers.results.rundir import read_run

    run = read_run(path)  # refuses a directory that is not a run
    result = RunResult.from_dict(run["result"]) if run["complete"] else None
    privacy = summary.shown_privacy(result, privacy_summary(path))
    row: dict[str, Any] = {"run": Path(path).name or str(path), "algorithm": run["config"].get("algorithm")}
    if result is not None:
        return {**row, **summary.compare_row(result, privacy, "completed")}
    last = run["rounds"][-1] if run["rounds"] else {}
    metrics = {k: v for k, v in last.items() if _number(v) and k not in NOT_METRICS}
    runtime = run["config"].get("runtime", {}).get("runtime", "?")
    incomplete = RunResult(str(row["algorithm"]), f"incomplete ({len(run['rounds'])} rounds)", runtime, metrics)
    return {**row, **summary.compare_row(incomplete, privacy, incomplete.status)}


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
    drawable = [m for m in metrics if any(_number(r.get(m)) for r in rows)]  # a yes/no check has no bar
    if len(rows) < 2:
        return drawable
    return [m for m in drawable if m in primary or sum(_number(r.get(m)) for r in rows) >= 2]


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
    from fedpers.commands.summary import text_table

    metrics = [m for m in metrics if any(r.get(m) is not None for r in rows)]
    columns = list(FIXED) + metrics
    return "\n".join(text_table(columns, ([row.get(c) for c in columns] for row in rows), left=range(4), sep="  "))
