"""`fedpers sweep FILE.toml`: a grid of runs, one table, one figure per metric.

TOML keys:

- ``name``, ``algorithm``; ``repetitions`` (Monte-Carlo runs per grid point, default 1)
- ``x``: the config field on the x-axis; ``series``: the field drawn as one line per value
- ``metrics``: result keys to tabulate and plot (``baselines.NAME.METRIC`` reaches a baseline)
- ``[base]``: fixed config fields; ``[grid]``: lists, run as their full product
- ``[series_values]`` (optional): label -> table of config overrides, when a line is a
  scenario rather than one field's value (then ``series`` is just the column name)
- ``[plot]`` (optional): ``xscale``/``yscale`` (``log`` or ``linear``), ``baselines``
  (list of baseline names drawn dashed)

An experiment with ``sweep_point(cfg, repetitions)`` computes all repetitions of a point
at once (vectorised); otherwise each repetition is a normal run with seed ``seed + r``.
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import time
import tomllib
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from tqdm.auto import tqdm

from fedpers import summaries

from fedpers import config as config_lib
from fedpers.results import dumps, write_atomic

META_COLUMNS = ("repetition", "seconds")


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    name: str
    algorithm: str
    x: str
    series: str
    metrics: tuple[str, ...]
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    series_values: dict[str, dict[str, Any]]
    repetitions: int = 1
    plot: dict[str, Any] = dataclasses.field(default_factory=dict)

    def points(self) -> list[tuple[str | None, dict[str, Any]]]:
        """(series label, config overrides) for every grid point."""
        keys = list(self.grid)
        combos = [dict(zip(keys, vals)) for vals in itertools.product(*(self.grid[k] for k in keys))] or [{}]
        if not self.series_values:
            return [(None, c) for c in combos]
        return [(label, {**c, **over}) for label, over in self.series_values.items() for c in combos]


TOP_KEYS = ("name", "algorithm", "x", "series", "metrics", "base", "grid", "series_values", "repetitions", "plot")
PLOT_KEYS = ("xscale", "yscale", "baselines", "layout")
SCALES = ("log", "linear")


def _check_structure(raw: dict[str, Any], fields: set[str], file: str) -> None:
    """Every key and value type of a sweep file, refused with the key's name before any point runs."""
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise ValueError(f"sweep: {file}: unknown key(s) {unknown}; allowed: {list(TOP_KEYS)}")
    for key in ("algorithm", "x", "series", "metrics"):
        if key not in raw:
            raise ValueError(f"sweep: {file} lacks required key {key!r}")
    for key in ("x", "series", "name"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"sweep: {key} must be a string; got {raw[key]!r}")
    metrics = raw["metrics"]
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise ValueError(f"sweep: metrics must be a non-empty list of result keys, e.g. [\"excess_risk\"]; got {metrics!r}")
    for key in ("base", "grid", "series_values", "plot"):
        if key in raw and not isinstance(raw[key], dict):
            raise ValueError(f"sweep: [{key}] must be a table; got {raw[key]!r}")
    for key, values in raw.get("grid", {}).items():
        if key not in fields:
            raise ValueError(f"sweep: grid key {key!r} is not a config field; fields: {', '.join(sorted(fields))}")
        if isinstance(values, list) and not values:
            raise ValueError(f"sweep: grid.{key} is an empty list; give at least one value")
    for key in raw.get("base", {}):
        if key not in fields:
            raise ValueError(f"sweep: base key {key!r} is not a config field; fields: {', '.join(sorted(fields))}")
    for label, over in raw.get("series_values", {}).items():
        if not isinstance(over, dict):
            raise ValueError(f"sweep: series_values.{label} must be a table of config overrides; got {over!r}")
    if raw["x"] not in fields:
        raise ValueError(f"sweep: x = {raw['x']!r} is not a config field; fields: {', '.join(sorted(fields))}")
    if not raw.get("series_values") and raw["series"] not in fields:
        raise ValueError(f"sweep: series = {raw['series']!r} is not a config field (or give [series_values]); fields: {', '.join(sorted(fields))}")
    reps = raw.get("repetitions", 1)
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"sweep: repetitions must be an integer >= 1; got {reps!r}")
    plot = raw.get("plot", {})
    unknown = sorted(set(plot) - set(PLOT_KEYS))
    if unknown:
        raise ValueError(f"sweep: [plot] unknown key(s) {unknown}; allowed: {list(PLOT_KEYS)}")
    for key in ("xscale", "yscale"):
        if key in plot and plot[key] not in SCALES:
            raise ValueError(f"sweep: plot.{key} must be one of {list(SCALES)}; got {plot[key]!r}")


def load_spec(path: str | Path, repetitions: int | None = None) -> SweepSpec:
    from fedpers.experiments import ALGORITHMS, EXPERIMENTS

    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"sweep: cannot read {path}: {e}") from None
    if raw.get("algorithm") not in ALGORITHMS:
        raise ValueError(f"sweep: algorithm must be one of {sorted(ALGORITHMS)}; got {raw.get('algorithm')!r}")
    fields = {f.name for f in dataclasses.fields(EXPERIMENTS[raw["algorithm"]].config_type)}
    _check_structure(raw, fields, path.name)
    grid = {k: (v if isinstance(v, list) else [v]) for k, v in raw.get("grid", {}).items()}
    if repetitions is not None and (isinstance(repetitions, bool) or not isinstance(repetitions, int) or repetitions < 1):
        raise ValueError(f"repetitions must be an integer >= 1; got {repetitions!r}")
    reps = int(repetitions if repetitions is not None else raw.get("repetitions", 1))
    spec = SweepSpec(
        name=str(raw.get("name", path.stem)), algorithm=raw["algorithm"], x=raw["x"], series=raw["series"],
        metrics=tuple(raw["metrics"]), base=dict(raw.get("base", {})), grid=grid,
        series_values=dict(raw.get("series_values", {})), repetitions=reps, plot=dict(raw.get("plot", {})),
    )
    cfg_type = EXPERIMENTS[spec.algorithm].config_type
    for label, over in spec.points():  # validate every point before any work
        config_lib.build(cfg_type, {**spec.base, **over})
    return spec


def _lookup(result: dict[str, Any], key: str, default: Any = None) -> Any:
    """``result["a"]["b"]`` for key ``a.b``; ``default`` where the path does not exist."""
    value: Any = result
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


_number = summaries.number


def run_point(spec: SweepSpec, overrides: dict[str, Any]) -> list[dict[str, float]]:
    """All repetitions of one grid point, as rows of metrics (run in this process, nothing written)."""
    from fedpers.sweep_points import run_point_task

    return run_point_task(spec, overrides)[0]


def result_row(spec: SweepSpec, result: dict[str, Any]) -> dict[str, Any]:
    """A run's row of the sweep table: its time, the metrics asked for, the ε spent, baselines."""
    row = {"seconds": result["seconds"]}
    for key in spec.metrics:
        row[key] = _number(_lookup(result, key))
    row["epsilon_spent"] = _number(_lookup(result, "epsilon"))
    for b in spec.plot.get("baselines", []):
        for m in spec.metrics:
            if "." not in m:
                row[f"baselines.{b}.{m}"] = _number(_lookup(result, f"baselines.{b}.{m}"))
    return row


def check_metrics(spec: SweepSpec, result: dict[str, Any]) -> None:
    """A metric the result does not have stops the sweep at its first point, naming what it has."""
    missing = [key for key in spec.metrics if not _has(result, key)]
    if missing:
        numeric = sorted(k for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("_"))
        baselines = sorted(result.get("baselines", {})) if isinstance(result.get("baselines"), dict) else []
        raise ValueError(
            f"sweep: metric(s) {missing} not in {spec.algorithm}'s result; available: {', '.join(numeric)}"
            + (f"; baselines.NAME.METRIC with NAME in {', '.join(baselines)}" if baselines else "")
        )


_MISSING = object()


def _has(result: dict[str, Any], key: str) -> bool:
    return _lookup(result, key, _MISSING) is not _MISSING


def loglog_slope(x: Iterable[float], y: Iterable[float]) -> float:
    """Least-squares slope of log y on log x over finite positive points (nan if fewer than 2)."""
    pts = [(a, b) for a, b in zip(x, y) if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)]
    if len(pts) < 2:
        return math.nan
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(lx, ly, 1)[0])


def summarise(rows: list[dict[str, Any]], spec: SweepSpec, metric: str) -> dict[Any, list[tuple[float, float, float]]]:
    """series value -> [(x, mean, standard error)] sorted by x."""
    return summaries.summarise(rows, spec.series, spec.x, metric)


def plot_metric(rows: list[dict[str, Any]], spec: SweepSpec, metric: str, path: Path) -> dict[Any, float]:
    """Write :func:`sweep_figure` to ``path``; returns the fitted log–log slopes."""
    from fedpers.plots import _plt

    fig, slopes = sweep_figure(rows, spec, metric)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    _plt().close(fig)
    tmp.replace(path)
    return slopes


def sweep_figure(rows: list[dict[str, Any]], spec: SweepSpec, metric: str) -> tuple[Any, dict[Any, float]]:
    """Mean ± 2 standard errors vs x, a line per series value, ticks at the grid's x values."""
    from fedpers.plots import _plt

    fig, ax = _plt().subplots(figsize=(6, 4.2))
    slopes: dict[Any, float] = {}
    for s, pts in summarise(rows, spec, metric).items():
        xs, ms, ses = (np.array(c) for c in zip(*pts))
        slopes[s] = loglog_slope(xs, ms)
        label = f"{spec.series}={s}" + (f" (slope {slopes[s]:.2f})" if math.isfinite(slopes[s]) else "")
        line, = ax.plot(xs, ms, marker="o", label=label)
        ax.fill_between(xs, np.maximum(ms - 2 * ses, ms * 1e-3 if (ms > 0).all() else ms - 2 * ses), ms + 2 * ses, color=line.get_color(), alpha=0.2)
    for b in spec.plot.get("baselines", []):
        key = f"baselines.{b}.{metric}"
        for s, pts in summarise(rows, spec, key).items():
            xs, ms, _ = (np.array(c) for c in zip(*pts))
            ax.plot(xs, ms, linestyle="--", marker=".", label=f"baseline: {b}")
            break
    from fedpers.plots import grid_ticks, y_scale

    xs_all = [float(r[spec.x]) for r in rows if isinstance(r.get(spec.x), (int, float))]
    grid_ticks(ax, xs_all, spec.plot.get("xscale", "log"))
    ax.set_yscale(spec.plot.get("yscale") or y_scale(metric, [v for line in ax.lines for v in line.get_ydata()]))
    ax.set_xlabel(spec.x)
    ax.set_ylabel(metric)
    ax.set_title(f"{spec.name}: {metric} (±2 s.e., B={spec.repetitions})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, slopes


def write_table(rows: list[dict[str, Any]], path: Path) -> None:
    """``path`` (.csv) and the same table as Parquet beside it, each written whole then renamed."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    write_parquet(rows, columns, path.with_suffix(".parquet"))


def write_parquet(rows: list[dict[str, Any]], columns: list[str], path: Path) -> None:
    """Numeric columns as float64 (None/NaN where a row lacks the value), any other as strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {}
    for c in columns:
        values = [row.get(c) for row in rows]
        if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            arrays[c] = pa.array([math.nan if v is None else float(v) for v in values], pa.float64())
        else:
            arrays[c] = pa.array([None if v is None else str(v) for v in values], pa.string())
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table(arrays), tmp)
    tmp.replace(path)


def run_sweep(
    path: str | Path, out: str | Path | None = None, repetitions: int | None = None, progress: bool = True,
    workers: int = 1, ray_address: str = "",
) -> dict[str, Any]:
    """Run the whole grid; write table.csv/.parquet, sweep.json (spec + slopes), a PNG per metric.

    Each point's repetitions are run directories under ``points/``; a point whose record exists
    is reused, never rerun. ``workers`` > 1 runs points concurrently on a new local Ray,
    ``ray_address`` on a running Ray cluster (at most ``workers`` points in flight).
    """
    from fedpers.experiments import EXPERIMENTS
    from fedpers.sweep_points import executor, write_runs

    run_points = executor(workers, ray_address)  # refuses a bad worker count before any work
    spec = load_spec(path, repetitions)
    out = Path(out) if out is not None else Path("runs") / f"sweep-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    identity = json.loads(dumps(dataclasses.asdict(spec)))
    if (out / "spec.json").exists():
        if json.loads((out / "spec.json").read_text()) != identity:
            raise ValueError(f"out: {out} holds a different sweep (its spec.json differs); choose another --out")
    elif (out / "table.csv").exists():
        raise ValueError(f"out: {out} already holds a sweep; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    from fedpers.results import lock_directory

    lock = lock_directory(out)  # a second sweep into the same directory is refused while this one runs
    try:
        (out / "points").mkdir(exist_ok=True)
        write_atomic(out / "spec.json", dumps(identity) + "\n")
        from fedpers.provenance import provenance

        record_of = provenance()
        write_atomic(out / "provenance.json", dumps({**record_of, "workers": workers, "ray_address": ray_address}) + "\n")
        points = spec.points()
        done: dict[int, list[dict[str, Any]]] = {}
        tasks = []
        for index, (label, overrides) in enumerate(points):
            record = out / "points" / f"{index:05d}.json"
            if record.exists():  # finished before an interruption: reuse, never rerun
                done[index] = json.loads(record.read_text())["rows"]
            else:
                tasks.append((index, overrides))
        reused = len(done)

        def table() -> list[dict[str, Any]]:
            rows = []
            for index in sorted(done):
                label, overrides = points[index]
                full = {**spec.base, **overrides}
                tag = {spec.series: label if label is not None else full.get(spec.series), spec.x: full.get(spec.x)}
                fixed = {**tag, **{k: v for k, v in overrides.items() if k not in tag}}
                rows += [{**fixed, **{k: v for k, v in row.items() if k not in fixed}} for row in done[index]]
            return rows

        bar = tqdm(total=len(points), initial=reused, desc=f"sweep {spec.name}", unit="point", disable=not progress)
        for index, (point_rows, runs) in run_points(spec, tasks):
            write_runs(out / "points", index, runs)
            label, overrides = points[index]
            write_atomic(out / "points" / f"{index:05d}.json", dumps({"label": label, "overrides": overrides, "rows": point_rows, "runs": sorted(f"{index:05d}-{n}" for n in runs)}) + "\n")
            done[index] = point_rows
            write_table(table(), out / "table.csv")
            bar.update(1)
        bar.close()
        rows = table()
        ran = len(points) - reused
    finally:
        lock.close()
    exp = EXPERIMENTS[spec.algorithm]
    slopes: dict[str, dict[str, float]] = {}
    figures = []
    if hasattr(exp, "sweep_figure"):  # a custom layout, or None for the default figures
        figures = list(exp.sweep_figure(rows, spec, out) or [])
    if not figures:
        for metric in spec.metrics:
            name = metric.replace(".", "_") + ".png"
            slopes[metric] = {str(k): v for k, v in plot_metric(rows, spec, metric, out / name).items()}
            figures.append(name)
    if rows and not (out / "table.csv").exists():
        write_table(rows, out / "table.csv")
    summary = {"spec": dataclasses.asdict(spec), "rows": len(rows), "points_run": ran, "points_reused": reused, "slopes": slopes, "figures": figures, "table": "table.csv", "parquet": "table.parquet"}
    write_atomic(out / "sweep.json", dumps(summary) + "\n")
    summary["out"] = str(out)  # where it went (not part of sweep.json: the directory may move)
    print(f"sweep {spec.name}: {len(rows)} rows ({ran} points run, {reused} reused) -> {out / 'table.csv'} (and .parquet); figures: {', '.join(figures)}")
    for metric, per in slopes.items():
        for s, slope in per.items():
            print(f"  log-log slope of {metric} vs {spec.x} at {spec.series}={s}: {slope:.3f}")
    return summary
