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
- a key that names a runtime option (``dp_model``, ``bits``, ``min_nodes``, ``nodes``, ...) sets it for
  the point's runs, in ``[base]``, ``[grid]`` or ``[series_values]`` alike
- ``[references]`` (optional): label -> table of config overrides of a point run once (not per grid
  value) and drawn as a horizontal dashed line on every figure, e.g. ``"non-private" = { epsilon = inf }``
- ``columns`` (optional): result keys recorded in the table beside the metrics but not plotted, blank
  where a run has none (e.g. ``modular_wraps``: only a modular sum has it)

A repetition refused before any release on its declared values alone (e.g. too few ``bits`` for the sum
of n units) is recorded as a row with its ``refused`` reason, named in the figure's legend and in
sweep.json's ``refused``; the sweep goes on. Any other error stops it.

An experiment with ``sweep_point(cfg, repetitions)`` computes all repetitions of a point
at once (vectorised); otherwise each repetition is a normal run with seed ``seed + r``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.results import summaries
from fedpers.results.rundir import dumps, write_atomic
from fedpers.sweeps.spec import SweepSpec, check_metrics, load_spec, result_row

__all__ = ["SweepSpec", "check_metrics", "load_spec", "plot_metric", "result_row", "run_sweep", "sweep_figure"]


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
    from fedpers.results.plots import _plt

    fig, slopes = sweep_figure(rows, spec, metric)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    _plt().close(fig)
    tmp.replace(path)
    return slopes


def sweep_figure(rows: list[dict[str, Any]], spec: SweepSpec, metric: str) -> tuple[Any, dict[Any, float]]:
    """Mean ± 2 standard errors vs x, a line per series value, ticks at the grid's x values."""
    from fedpers.results.plots import _plt

    fig, ax = _plt().subplots(figsize=(6, 4.2))
    slopes = draw_metric(ax, rows, spec, metric)
    fig.tight_layout()
    return fig, slopes


def draw_metric(ax: Any, rows: list[dict[str, Any]], spec: SweepSpec, metric: str) -> dict[Any, float]:
    """:func:`sweep_figure`'s panel on ``ax`` (a sweep set draws its members side by side); returns the
    fitted log–log slopes."""
    from fedpers.results.quantities import field_label

    slopes: dict[Any, float] = {}
    series_label = field_label(spec.series)
    lines = [r for r in rows if r.get(spec.series) not in spec.references]
    for s, pts in summarise(lines, spec, metric).items():
        xs, ms, ses = (np.array(c) for c in zip(*pts))
        slopes[s] = loglog_slope(xs, ms)
        label = f"{series_label} = {s}" + (f" (log–log slope {slopes[s]:.2f})" if math.isfinite(slopes[s]) else "")
        (line,) = ax.plot(xs, ms, marker="o", label=label)
        if spec.repetitions >= 2:  # one run per point has no spread to show
            ax.fill_between(
                xs,
                np.maximum(ms - 2 * ses, ms * 1e-3 if (ms > 0).all() else ms - 2 * ses),
                ms + 2 * ses,
                color=line.get_color(),
                alpha=0.2,
            )
    for b in spec.plot.get("baselines", []):
        key = f"baselines.{b}.{metric}"
        for _, pts in summarise(lines, spec, key).items():
            xs, ms, _ = (np.array(c) for c in zip(*pts))
            ax.plot(xs, ms, linestyle="--", marker=".", label=f"baseline: {b}")
            break
    for label in spec.references:  # run once each: a horizontal line at its mean
        values = [
            v for r in rows if r.get(spec.series) == label and math.isfinite(v := summaries.number(r.get(metric)))
        ]
        if values:
            ax.axhline(
                float(np.mean(values)), color="k", linestyle="--", linewidth=1, label=f"{label} (mean of {len(values)})"
            )
    for label in refusals(rows, spec):  # a series refused before any release: said in the legend (why: sweep.json)
        ax.plot([], [], linestyle="none", label=f"{series_label} = {label}: refused before any release")
    from fedpers.results.plots import grid_ticks, spread_note, y_scale

    xs_all = [float(r[spec.x]) for r in lines if isinstance(r.get(spec.x), (int, float))]
    grid_ticks(ax, xs_all, spec.plot.get("xscale", "log"))
    ax.set_yscale(spec.plot.get("yscale") or y_scale(metric, [v for line in ax.lines for v in line.get_ydata()]))
    x_label, y_label = axis_labels(spec, metric)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(spec.plot.get("title") or f"{spec.name}: {y_label}\n{spread_note(spec.repetitions)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return slopes


def axis_labels(spec: SweepSpec, metric: str) -> tuple[str, str]:
    """(x, y) axis labels: ``[plot] xlabel``/``ylabel`` where given, else the swept field's name in
    words (``epsilon``: the target ε, not the ε spent) and the metric's label and unit as its
    algorithm defines it (``baselines.NAME.METRIC``: the metric's, naming the baseline)."""
    from fedpers.experiments import ALGORITHMS, experiment
    from fedpers.results.quantities import field_label, quantity

    own = experiment(spec.algorithm).quantities if spec.algorithm in ALGORITHMS else None
    parts = metric.split(".")
    if len(parts) == 3 and parts[0] == "baselines":
        y = f"{quantity(parts[2], own).axis_label}, baseline {parts[1].replace('_', ' ')}"
    else:
        y = quantity(parts[-1], own).axis_label
    return str(spec.plot.get("xlabel") or field_label(spec.x)), str(spec.plot.get("ylabel") or y)


def refusals(rows: list[dict[str, Any]], spec: SweepSpec) -> dict[Any, str]:
    """Series label → why, for every series with a repetition refused before any release (its reasons,
    distinct, joined)."""
    out: dict[Any, list[str]] = {}
    for r in rows:
        if r.get("refused"):
            reasons = out.setdefault(r.get(spec.series), [])
            if r["refused"] not in reasons:
                reasons.append(str(r["refused"]))
    return {k: "; ".join(v) for k, v in out.items()}


def run_sweep(
    path: str | Path,
    out: str | Path | None = None,
    repetitions: int | None = None,
    progress: bool = True,
    workers: int = 1,
    ray_address: str = "",
    labels: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """Run the whole grid; write table.csv/.parquet, sweep.json (spec + slopes), a PNG per metric
    (``labels``: ``[plot]`` axis labels and title over the file's).

    The steps: check everything (:func:`~fedpers.sweeps.spec.load_spec`), open the sweep
    directory (:class:`~fedpers.results.rundir.SweepDirectory`: a point whose record exists is reused,
    never rerun), run the missing points (:func:`~fedpers.sweeps.points.run_points`), draw and
    summarise (here). ``workers`` > 1 runs points concurrently on a new local Ray,
    ``ray_address`` on a running Ray cluster (at most ``workers`` points in flight).
    """
    from fedpers.results.rundir import SweepDirectory
    from fedpers.sweeps.points import executor, run_points

    run = executor(workers, ray_address)  # refuses a bad worker count before any work
    spec = load_spec(path, repetitions, labels)  # every check, metrics included, before any work
    out = Path(out) if out is not None else Path("runs") / f"sweep-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    with SweepDirectory(out, spec.identity(), {"workers": workers, "ray_address": ray_address}) as sweep_dir:
        ran, reused = run_points(spec, sweep_dir, run, progress)
    rows = spec.table(sweep_dir.done())
    figures, slopes = draw(spec, rows, out)
    return summarise_sweep(spec, rows, out, ran, reused, figures, slopes)


def draw(spec: SweepSpec, rows: list[dict[str, Any]], out: Path) -> tuple[list[str], dict[str, dict[str, float]]]:
    """The algorithm's own sweep figures if it has them, else one PNG per metric with its log–log slopes."""
    from fedpers.experiments import experiment

    exp = experiment(spec.algorithm)
    slopes: dict[str, dict[str, float]] = {}
    figures: list[str] = []
    if hasattr(exp, "sweep_figure"):  # a custom layout, or None for the default figures
        figures = list(exp.sweep_figure(rows, spec, out) or [])
    if not figures:
        for metric in spec.metrics:
            name = metric.replace(".", "_") + ".png"
            slopes[metric] = {str(k): v for k, v in plot_metric(rows, spec, metric, out / name).items()}
            figures.append(name)
    return figures, slopes


def summarise_sweep(
    spec: SweepSpec,
    rows: list[dict[str, Any]],
    out: Path,
    ran: int,
    reused: int,
    figures: list[str],
    slopes: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """sweep.json, and the lines a user reads."""
    from fedpers.results.rundir import write_table

    if rows and not (out / "table.csv").exists():
        write_table(rows, out / "table.csv")
    refused = refusals(rows, spec)
    summary: dict[str, Any] = {
        "spec": dataclasses.asdict(spec),
        "rows": len(rows),
        "points_run": ran,
        "points_reused": reused,
        "slopes": slopes,
        "figures": figures,
        **({"refused": refused} if refused else {}),
        "table": "table.csv",
        "parquet": "table.parquet",
    }
    write_atomic(out / "sweep.json", dumps(summary) + "\n")
    summary["out"] = str(out)  # where it went (not part of sweep.json: the directory may move)
    summary["table_rows"] = rows  # in memory only, for a sweep set's combined figure
    print(
        f"sweep {spec.name}: {len(rows)} rows ({ran} points run, {reused} reused) -> {out / 'table.csv'} (and .parquet); figures: {', '.join(figures)}"
    )
    for label, why in refused.items():
        print(f"  {spec.series}={label}: refused before any release: {why}")
    for metric, per in slopes.items():
        for s, slope in per.items():
            print(f"  log-log slope of {metric} vs {spec.x} at {spec.series}={s}: {slope:.3f}")
    return summary
