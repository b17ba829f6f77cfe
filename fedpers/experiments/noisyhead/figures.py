"""The figures of a NoisyHead sweep (excess risk against N, ε or the attack's size, with bands)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def sweep_figure(rows: list[dict[str, Any]], spec: Any, out: Path) -> list[str] | None:
    """Custom layouts (``[plot] layout``): ``descent-privacy`` (§6.2, §7) and ``robustness`` (§6.3)."""
    layout = spec.plot.get("layout", "default")
    if layout == "default":
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedpers.results.summaries import summarise as _summarise

    def summarise(rows, spec, metric):
        return _summarise(rows, spec.series, spec.x, metric)

    if layout == "descent-privacy":
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
        descent = summarise(rows, spec, "gd_excess_risk")
        first = next(iter(descent.values()))  # GD does not depend on the series (ε or calibration)
        _band(axes[0], first, "non-private GD after T steps")
        _style(axes[0], spec, "cost of descent: (<Γ_GD − Γ*, Z>)²", spec.x, "excess risk")
        for s, pts in summarise(rows, spec, "excess_risk").items():
            _band(axes[1], pts, f"NoisyHead, {spec.series}={s}")
            best = min(pts, key=lambda p: p[1])
            print(
                f"  {spec.name}: cost of privacy at {spec.series}={s} is smallest at {spec.x}={best[0]:g} ({best[1]:.3g})"
            )
        xs, ms, _ = zip(*first)
        axes[1].plot(xs, ms, linestyle="--", color="grey", label="cost of descent")
        _style(axes[1], spec, "cost of privacy: (<Γ_DP − Γ*, Z>)²", spec.x, "excess risk")
    elif layout == "robustness":
        groups = sorted({row[spec.series] for row in rows})
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.2), squeeze=False)
        for ax, gval in zip(axes[0], groups):
            sub = [row for row in rows if row[spec.series] == gval]
            for metric, label in (
                ("robust_ridge", "ridge Γ*"),
                ("robust_noisyhead", "NoisyHead"),
                ("robust_ridge_naive_solve", "ridge, naive float64 solve"),
            ):
                for _, pts in summarise(sub, spec, metric).items():
                    _band(ax, pts, label, linestyle=":" if "naive" in metric else "-")
            _style(ax, spec, f"{spec.series} = {gval}", spec.x, "(<Γ − Γ_bad, Z>)²")
    else:
        raise ValueError(f"[plot] layout must be default, descent-privacy or robustness; got {layout!r}")
    from fedpers.results.plots import spread_note

    if spec.repetitions < 2:  # one seed per point: no spread to draw
        for ax in fig.axes:
            for band in list(ax.collections):
                band.remove()
    fig.suptitle(f"{spec.name}: {spread_note(spec.repetitions)}", fontsize=10)
    fig.tight_layout()
    name = f"{spec.name}.png"
    tmp = out / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out / name)
    return [name]


def _band(ax: Any, pts: list[tuple[float, float, float]], label: str, linestyle: str = "-") -> None:
    xs, ms, ses = (torch.tensor(c, dtype=torch.float64) for c in zip(*pts))
    (line,) = ax.plot(xs, ms, marker="o", markersize=3, label=label, linestyle=linestyle)
    lo = torch.where(ms - 2 * ses > 0, ms - 2 * ses, ms * 0.5)
    ax.fill_between(xs, lo, ms + 2 * ses, color=line.get_color(), alpha=0.2)


def _style(ax: Any, spec: Any, title: str, xlabel: str, ylabel: str) -> None:
    from fedpers.results.plots import grid_ticks

    grid_ticks(ax, [float(x) for line in ax.lines for x in line.get_xdata()], spec.plot.get("xscale", "linear"))
    ax.set_yscale(spec.plot.get("yscale", "log"))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
