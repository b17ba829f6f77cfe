"""`fedpers compare RUN_DIR...`: runs side by side — privacy spent, noise, primary metrics, time.

Runs of different algorithms compare too: the table shows one block per algorithm with the
metrics its runs share; ``--json`` keeps the union of the metric columns. A killed run is shown with the releases it made and its last
round's metrics, marked incomplete.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIXED = (
    "run",
    "algorithm",
    "trust_model",
    "runtime",
    "status",
    "epsilon",
    "target_epsilon",
    "delta",
    "noise_multiplier",
    "seconds",
)
"""A row's identity, trust model, privacy and time: every run has them (``-`` where one is not recorded)."""
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
RUN_COLUMNS = ("run", "epsilon")
"""The metrics table's first columns: which run, and the ε it spent (what a comparison is read against)."""
DETAIL_COLUMNS = (
    "run",
    "algorithm",
    "trust_model",
    "runtime",
    "status",
    "target_epsilon",
    "delta",
    "noise_multiplier",
    "seconds",
)
"""The details table's columns before the runs' own counts and settings."""
LABELS = {
    "run": "run",
    "algorithm": "algorithm",
    "trust_model": "trust model",
    "runtime": "runtime",
    "status": "status",
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
    row: dict[str, Any] = {
        "run": Path(path).name or str(path),
        "algorithm": run["config"].get("algorithm"),
        "trust_model": run["config"].get("runtime", {}).get("dp_model", "central"),
    }
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
    """(rows, metric columns, primary metrics): each algorithm's primary metric first, then the rest of
    the figures each algorithm calls a metric (its counts and settings are details, not columns)."""
    from fedpers.commands.summary import quantities_of
    from fedpers.experiments import ALGORITHMS, experiment
    from fedpers.results.quantities import Kind, quantity

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

    def is_metric(row: dict[str, Any], key: str) -> bool:
        return quantity(key, quantities_of(str(row["algorithm"]))).kind in (Kind.METRIC, Kind.SCORE)

    others = [k for row in rows for k in row if k not in FIXED and k not in primary and is_metric(row, k)]
    return rows, primary + list(dict.fromkeys(others)), primary


def details(rows: list[dict[str, Any]], metrics: list[str]) -> list[str]:
    """The keys of the runs' counts and settings: every figure that is neither a fixed column nor a metric."""
    return list(
        dict.fromkeys(k for row in rows for k in row if k not in FIXED and k not in metrics and _scalar(row[k]))
    )


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float))


def figure_metrics(rows: list[dict[str, Any]], metrics: list[str], primary: list[str]) -> list[str]:
    """The panels worth drawing: every primary metric, and any other that at least two runs share; never
    one whose every value is 0 (a panel of empty bars says nothing)."""
    drawable = [
        m
        for m in metrics
        if any(_number(r.get(m)) for r in rows) and any(_number(r.get(m)) and r[m] != 0 for r in rows)
    ]
    if len(rows) < 2:
        return drawable
    return [m for m in drawable if m in primary or sum(_number(r.get(m)) for r in rows) >= 2]


def column_labels(rows: list[dict[str, Any]], keys: Sequence[str]) -> dict[str, str]:
    """Each column's header in words (the first algorithm that defines it)."""
    from fedpers.commands.summary import quantities_of
    from fedpers.results.quantities import quantity

    own: dict[str, Any] = {}
    for name in dict.fromkeys(str(r.get("algorithm")) for r in rows):
        own = {**quantities_of(name), **own}
    return {k: LABELS.get(k) or quantity(k, own).axis_label for k in keys}


def definitions(rows: list[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """A footnote per metric column: its label and definition."""
    from fedpers.commands.summary import quantities_of
    from fedpers.results.quantities import quantity

    own: dict[str, Any] = {}
    for name in dict.fromkeys(str(r.get("algorithm")) for r in rows):
        own = {**quantities_of(name), **own}
    return [f"  {quantity(k, own).label}: {quantity(k, own).definition}" for k in keys if quantity(k, own).definition]


def format_table(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    """The runs as two tables: the metrics (a row per run, ε spent first, a column per metric, each
    defined below it), then the details (algorithm, trust model, runtime, status, target ε, δ, z, time,
    and the runs' counts and settings). Runs of several algorithms are shown as one block per algorithm,
    each with only the metrics its runs have (a union over algorithms is mostly blanks: 31 columns for
    altmin beside dpals); within a block a column no run has is left out."""
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
    first = [*RUN_COLUMNS, *metrics]
    second = [*DETAIL_COLUMNS, *details(rows, metrics)]
    second = [c for c in second if c == "run" or any(r.get(c) is not None for r in rows)]
    labels = column_labels(rows, [*first, *second])
    lines = text_table([labels[c] for c in first], ([row.get(c) for c in first] for row in rows), left=(0,), sep="  ")
    lines += definitions(rows, metrics)
    lines.append("")
    lines += text_table(
        [labels[c] for c in second], ([row.get(c) for c in second] for row in rows), left=range(5), sep="  "
    )
    return "\n".join(lines)
