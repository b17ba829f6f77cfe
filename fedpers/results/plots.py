"""Figures a reader can trust: per-run metric curves, sweep curves, run comparisons.

Rules shared by all of them: accuracies and other [0, 1] scores on linear axes, errors on a
log axis only when every value is positive; the ε actually spent (not the target) in the
title; baselines as labelled reference lines; sweep ticks at the grid's own values.
Every figure is written whole (temporary file, then rename) and returned as a
matplotlib ``Figure`` too, so tests can inspect it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.results.quantities import Quantity, quantity

LINEAR_WORDS = ("accuracy", "auc", "precision", "recall", "fraction", "rate")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def is_linear_metric(name: str) -> bool:
    """Scores bounded in [0, 1] (accuracies, rates) read on a linear axis."""
    return any(w in name.lower() for w in LINEAR_WORDS)


def y_scale(name: str, values: Iterable[object]) -> str:
    """``"log"`` for an error metric whose finite numbers (others are skipped) are all positive, else ``"linear"``."""
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if is_linear_metric(name) or not finite or min(finite) <= 0:
        return "linear"
    return "log"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "∞" if math.isinf(v) else f"{v:.3g}"
    return str(v)


def privacy_title(algorithm: str, privacy: Mapping[str, Any]) -> str:
    """``altmin: ε = 3.99 spent (target 4), δ = 1e-05, pld`` from a result's privacy summary."""
    eps = privacy.get("epsilon")
    if eps is None:
        return algorithm
    text = f"{algorithm}: ε = {_fmt(float(eps))} spent"
    target = privacy.get("target_epsilon")
    if target is not None and _fmt(float(target)) != _fmt(float(eps)):
        text += f" (target {_fmt(float(target))})"
    if privacy.get("delta") is not None:
        text += f", δ = {float(privacy['delta']):g}"
    if privacy.get("accountant"):
        text += f", {privacy['accountant']}"
    return text


def save(fig: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def run_figure(
    rounds: Sequence[Mapping[str, Any]],
    key: str,
    *,
    title: str,
    round_axis: str = "round",
    baselines: Mapping[str, Mapping[str, Any]] | None = None,
) -> Any:
    """One metric against the round, with each baseline's value of it as a dashed reference line."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    pts = [(r["round"], r[key]) for r in rounds if isinstance(r.get(key), (int, float))]
    if len(pts) == 1:  # one release (e.g. NoisyHead's statistics mode): a curve of one point says nothing
        return value_figure(key, float(pts[0][1]), baselines or {}, title=title)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    values = [v for _, v in pts if math.isfinite(v)]
    if pts:
        ax.plot(*zip(*pts), marker="o", label="private run")
    refs = {
        n: float(m[key])
        for n, m in (baselines or {}).items()
        if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])
    }
    scale = y_scale(key, values + list(refs.values()))
    # the view follows the private run; a baseline far outside it is named in the legend, not drawn
    lo, hi = (
        (min(values), max(values)) if values else (min(refs.values(), default=0.0), max(refs.values(), default=1.0))
    )
    pad = _pad(lo, hi) * 20
    span = (lo / 100, hi * 10) if scale == "log" and lo > 0 else (lo - pad, hi + pad)
    for name, v in refs.items():
        inside = span[0] <= v <= span[1]
        ax.axhline(
            v,
            linestyle="--",
            linewidth=1,
            color=f"C{len(ax.lines)}",
            label=f"{name.replace('_', ' ')} ({_fmt(v)}{'' if inside else ', off scale'})",
        )
        if inside:
            values.append(v)
    if values:
        lo, hi = min(values), max(values)
        ax.set_ylim(*((lo / 1.5, hi * 1.5) if scale == "log" and lo > 0 else linear_limits(lo, hi)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(round_axis)
    ax.set_ylabel(key.replace("_", " "))
    ax.set_yscale(scale)
    plain_numbers(ax.yaxis)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if len(ax.lines) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _pad(lo: float, hi: float) -> float:
    """5% of the span, or of the magnitude when the values (nearly) coincide, so a flat curve is
    drawn in a readable window instead of one 1e-12 wide."""
    return 0.05 * max(hi - lo, max(abs(lo), abs(hi)), 1e-12)


def linear_limits(lo: float, hi: float) -> tuple[float, float]:
    pad = _pad(lo, hi)
    return lo - pad, hi + pad


def plain_numbers(axis: Any) -> None:
    """Tick labels as plain numbers: never an offset such as "1e−13+4.148723236e−1"."""
    from matplotlib.ticker import ScalarFormatter

    formatter = axis.get_major_formatter()
    if isinstance(formatter, ScalarFormatter):
        formatter.set_useOffset(False)


def value_figure(key: str, value: float, baselines: Mapping[str, Mapping[str, Any]], *, title: str) -> Any:
    """A run's one value of ``key`` beside every baseline's, as horizontal bars (log scale when
    all are positive and span more than a decade), each labelled with its value."""
    plt = _plt()
    rows = [("private run", value)] + [
        (n.replace("_", " "), float(m[key]))
        for n, m in baselines.items()
        if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])
    ]
    fig, ax = plt.subplots(figsize=(5.5, 1.2 + 0.45 * len(rows)))
    names, values = [r[0] for r in rows], [r[1] for r in rows]
    positive = [v for v in values if v > 0]
    log = len(positive) == len(values) and max(values) / min(values) > 10
    ax.barh(range(len(rows)), values, color=[f"C{i % 10}" for i in range(len(rows))])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    else:
        plain_numbers(ax.xaxis)
    for i, v in enumerate(values):
        ax.annotate(_fmt(v), (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_xlabel(key.replace("_", " ") + (" (log scale)" if log else ""))
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


class PlotWorker:
    """A child process that imports matplotlib and loads its fonts while the run works, then draws
    the run directory's plots (:func:`plot_run`) when asked: the figures' library start-up leaves
    the run's critical path (it overlaps the run's own imports on a second core).

    The child reads one job from its stdin and answers on its stdout; it exits on end of input, so
    it ends with its parent whatever the parent's fate. Any failure (the child gone, an error, a
    timeout) gives None and the caller draws in its own process: same files either way."""

    def __init__(self) -> None:
        import subprocess
        import sys

        import fedpers

        env = dict(os.environ)
        root = str(Path(fedpers.__file__).resolve().parent.parent)  # the parent's fedpers, not another install
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self.proc: Any = subprocess.Popen(
            [sys.executable, "-m", "fedpers.results.plots"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )

    def plot_run(self, path: Path, rounds: Sequence[Mapping[str, Any]], keys: Iterable[str], **kwargs: Any) -> Any:
        """:func:`plot_run`'s answer drawn by the child, or None (then nothing was promised: the
        caller draws)."""
        import json
        import subprocess

        job = json.dumps({"path": str(path), "rounds": list(rounds), "keys": list(keys), **kwargs}, default=repr)
        try:
            out, _ = self.proc.communicate(job + "\n", timeout=600)
            answer = json.loads(out.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            self.close()
            return None
        return answer.get("written") if self.proc.returncode == 0 else None

    def close(self) -> None:
        """End the child (unused, or failed) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_WORKERS: list[PlotWorker] = []


def start_worker() -> None:
    """Start the process's :class:`PlotWorker` (one at most); a start that fails leaves none."""
    if not _WORKERS:
        try:
            _WORKERS.append(PlotWorker())
        except OSError:
            pass


def take_worker() -> PlotWorker | None:
    """The started worker, handed over once (None if none was started)."""
    return _WORKERS.pop() if _WORKERS else None


def stop_worker() -> None:
    """End a started worker that nothing took."""
    worker = take_worker()
    if worker is not None:
        worker.close()


def serve() -> None:
    """The :class:`PlotWorker` child: import and warm up matplotlib, then draw one job."""
    import json
    import sys

    plt = _plt()
    fig = run_figure([{"round": 0, "e": 1.0}, {"round": 1, "e": 0.5}], "e", title="ε δ", baselines={"b": {"e": 0.7}})
    fig.canvas.draw()  # fonts and text layout loaded before the job arrives
    plt.close(fig)
    line = sys.stdin.readline()
    if not line:
        return
    job = json.loads(line)
    written = plot_run(Path(job.pop("path")), job.pop("rounds"), job.pop("keys"), **job)
    print(json.dumps({"written": written}))


def plot_run(
    path: Path,
    rounds: Sequence[Mapping[str, Any]],
    keys: Iterable[str],
    *,
    title: str,
    round_axis: str = "round",
    baselines: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """One PNG per key that has per-round values; returns the file names written."""
    plt = _plt()
    written = []
    for key in keys:
        if not any(isinstance(r.get(key), (int, float)) for r in rounds):
            continue
        fig = run_figure(rounds, key, title=title, round_axis=round_axis, baselines=baselines)
        name = f"{key}.png"
        save(fig, path / name)
        plt.close(fig)
        written.append(name)
    return written


TICK_LABELS = 12
"""A grid of more x values than this labels every k-th tick only (ticks stay at every value), so labels never overlap."""


def grid_ticks(ax: Any, xs: Sequence[float], scale: str) -> None:
    """Major ticks exactly at the grid's x values, labelled with them (every k-th of a long grid, the first
    included); no minor labels."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    xs = sorted({float(x) for x in xs})
    every = -(-len(xs) // TICK_LABELS)
    ax.set_xscale(scale)
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.set_xticklabels(
        [
            _fmt(int(x) if float(x).is_integer() and abs(x) < 1e15 else x) if i % every == 0 else ""
            for i, x in enumerate(xs)
        ],
        rotation=30 if len(xs) > 6 else 0,
        fontsize=8,
    )
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


PANELS_ACROSS = 3
"""A grid of figure panels is at most this many wide (7 metrics: 3 + 3 + 1, not one row of 7)."""


def spread_note(repetitions: int) -> str:
    """What a sweep figure's bands are: mean ± 2 standard errors over B ≥ 2 seeds, or none (B = 1)."""
    if repetitions >= 2:
        return f"mean of B = {repetitions} seeds; band: ± 2 standard errors of the mean"
    return "one seed per point (B = 1): no error bars; set repetitions >= 2 for the spread"


def spans_decades(values: Sequence[float]) -> bool:
    """All positive and the largest over ten times the smallest: a log axis shows every value."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 10


def panel_grid(count: int, width: float = 4.2, height: float = 3.4) -> tuple[Any, list[Any]]:
    """A figure of ``count`` panels in rows of at most :data:`PANELS_ACROSS`, the unused cells removed."""
    plt = _plt()
    count = max(count, 1)
    across = min(PANELS_ACROSS, count)
    down = -(-count // across)
    fig, grid = plt.subplots(down, across, figsize=(width * across, height * down + 0.5), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[count:]:
        fig.delaxes(ax)
    return fig, axes[:count]


def compare_figure(
    rows: Sequence[Mapping[str, Any]], metrics: Sequence[str], quantities: Mapping[str, Quantity] | None = None
) -> Any:
    """One panel per metric in a grid (:func:`panel_grid`), one bar per run, each bar named by its run,
    its trust model and the ε it spent beside its target; a panel's axis is labelled with the metric's
    label and unit and is logarithmic where the values span more than a decade. A metric with no
    finite non-zero value gets no panel."""
    metrics = [
        m
        for m in metrics
        if any(isinstance(r.get(m), (int, float)) and math.isfinite(r[m]) and r[m] != 0 for r in rows)
    ]
    fig, axes = panel_grid(len(metrics))
    names = [
        f"{str(r['run'])[:24]}\n{r.get('trust_model') or 'central'}, ε {_fmt(r.get('epsilon'))}"
        + (f" (target {_fmt(r['target_epsilon'])})" if r.get("target_epsilon") is not None else "")
        for r in rows
    ]
    for ax, metric in zip(axes, metrics):
        q = quantity(metric, quantities)
        values = [float(r[metric]) if isinstance(r.get(metric), (int, float)) else float("nan") for r in rows]
        log = spans_decades(values)
        bars = ax.bar(range(len(rows)), values, color=[f"C{i % 10}" for i in range(len(rows))])
        ax.bar_label(bars, labels=[_fmt(v) for v in values], fontsize=7)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
        if log:
            from matplotlib.ticker import NullFormatter

            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())  # labels at the decades only
        else:
            plain_numbers(ax.yaxis)
        ax.set_ylabel(q.axis_label + (" (log scale)" if log else ""), fontsize=8)
        ax.set_title(q.label + (" (higher is better)" if q.higher_is_better else " (lower is better)"), fontsize=9)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("runs compared: ε is what each run spent (its target in brackets)", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    serve()
