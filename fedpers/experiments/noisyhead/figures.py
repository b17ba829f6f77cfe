"""The figures of a NoisyHead sweep (excess risk against N, ε or the attack's size, with bands)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def sweep_figure(rows: list[dict[str, Any]], spec: Any, out: Path) -> list[str] | None:
    """Custom layouts (``[plot] layout``): ``descent-privacy`` (§6.2, §7) and ``robustness`` (§6.3),
    written to ``out/NAME.png``; None for the default layout (the generic sweep figures)."""
    fig = layout_figure(rows, spec)
    if fig is None:
        return None
    from fedpers.results.plots import _plt

    name = f"{spec.name}.png"
    tmp = out / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=110)
    _plt().close(fig)
    tmp.replace(out / name)
    return [name]


def layout_figure(rows: list[dict[str, Any]], spec: Any) -> Any:
    """The ``[plot] layout`` figure (None for ``default``): axes named in words from the swept fields and
    the metrics (``[plot] xlabel``/``ylabel``/``title`` over them), panels in rows of at most
    :data:`~fedpers.results.plots.PANELS_ACROSS`, bands of ± 2 standard errors only when B ≥ 2."""
    layout = spec.plot.get("layout", "default")
    if layout == "default":
        return None
    if layout not in ("descent-privacy", "robustness"):
        raise ValueError(f"[plot] layout must be default, descent-privacy or robustness; got {layout!r}")
    from fedpers.results.plots import panel_grid, spread_note
    from fedpers.results.quantities import field_label
    from fedpers.results.summaries import summarise as _summarise

    def summarise(rows: list[dict[str, Any]], metric: str) -> dict[Any, list[tuple[float, float, float]]]:
        return _summarise(rows, spec.series, spec.x, metric)

    spread = spec.repetitions >= 2
    series = field_label(spec.series)
    x_label = str(spec.plot.get("xlabel") or field_label(spec.x))
    if layout == "descent-privacy":
        fig, axes = panel_grid(2, width=5.0, height=4.2)
        descent = summarise(rows, "gd_excess_risk")
        first = next(iter(descent.values()))  # GD does not depend on the series (ε or calibration)
        _band(axes[0], first, "non-private GD after T steps", spread)
        _style(
            axes[0], spec, "cost of descent: (<Γ_GD − Γ*, Z>)²", x_label, str(spec.plot.get("ylabel") or "excess risk")
        )
        for s, pts in summarise(rows, "excess_risk").items():
            _band(axes[1], pts, f"NoisyHead, {series} = {s}", spread)
            best = min(pts, key=lambda p: p[1])
            print(
                f"  {spec.name}: cost of privacy at {spec.series}={s} is smallest at {spec.x}={best[0]:g} ({best[1]:.3g})"
            )
        xs, ms, _ = zip(*first)
        axes[1].plot(xs, ms, linestyle="--", color="grey", label="cost of descent")
        _style(
            axes[1], spec, "cost of privacy: (<Γ_DP − Γ*, Z>)²", x_label, str(spec.plot.get("ylabel") or "excess risk")
        )
    else:
        groups = sorted({row[spec.series] for row in rows})
        fig, axes = panel_grid(len(groups), width=5.0, height=4.2)
        for ax, gval in zip(axes, groups):
            sub = [row for row in rows if row[spec.series] == gval]
            for metric, label in (
                ("robust_ridge", "ridge Γ*"),
                ("robust_noisyhead", "NoisyHead"),
                ("robust_ridge_naive_solve", "ridge, naive float64 solve"),
            ):
                for _, pts in summarise(sub, metric).items():
                    _band(ax, pts, label, spread, linestyle=":" if "naive" in metric else "-")
            _style(ax, spec, f"{series} = {gval}", x_label, str(spec.plot.get("ylabel") or "shift (<Γ − Γ_bad, Z>)²"))
    fig.suptitle(str(spec.plot.get("title") or f"{spec.name}: {spread_note(spec.repetitions)}"), fontsize=10)
    fig.tight_layout()
    return fig


def _band(ax: Any, pts: list[tuple[float, float, float]], label: str, spread: bool, linestyle: str = "-") -> None:
    """The means as a line; with ``spread`` (B ≥ 2) a band of ± 2 standard errors around them."""
    xs, ms, ses = (torch.tensor(c, dtype=torch.float64) for c in zip(*pts))
    (line,) = ax.plot(xs, ms, marker="o", markersize=3, label=label, linestyle=linestyle)
    if spread:
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
