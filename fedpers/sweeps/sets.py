"""A sweep set: one TOML naming several sweep files (a sweep is one algorithm; a figure may compare two).

    name = "trust_models"
    sweeps = ["trust_models_altmin.toml", "trust_models_fedrep.toml"]   # relative to this file

``fedpers sweep SET.toml --out OUT`` checks every member (:func:`~fedpers.sweeps.spec.load_spec`) before
any point runs, then runs each into ``OUT/<member's name>`` (a rerun reuses the points already there), and
draws ``OUT/<metric>.png`` for each metric every member has: the members' figures side by side.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import Any

SET_KEYS = ("name", "sweeps")


def sweep_set(path: str | Path) -> tuple[str, list[Path]] | None:
    """(name, member files) when ``path`` is a sweep set, None when it is a single sweep; a malformed
    set is refused naming the key."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None  # load_spec reports it
    if "sweeps" not in raw:
        return None
    unknown = sorted(set(raw) - set(SET_KEYS))
    if unknown:
        raise ValueError(f"sweep: {path.name} is a sweep set; unknown key(s) {unknown}; allowed: {list(SET_KEYS)}")
    members = raw["sweeps"]
    if not isinstance(members, list) or not members or not all(isinstance(m, str) and m for m in members):
        raise ValueError(f'sweep: sweeps must be a non-empty list of sweep files, e.g. ["a.toml"]; got {members!r}')
    files = [path.parent / m for m in members]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"sweep: sweeps: no such file(s) {missing}")
    return str(raw.get("name", path.stem)), files


def run_sweep_set(
    path: str | Path, out: str | Path | None = None, repetitions: int | None = None, **kw: Any
) -> dict[str, Any]:
    """Every member of the set checked, then run in turn (``kw``: :func:`~fedpers.sweeps.run.run_sweep`'s)."""
    from fedpers.sweeps.run import run_sweep
    from fedpers.sweeps.spec import load_spec

    found = sweep_set(path)
    if found is None:
        raise ValueError(f"sweep: {path} is not a sweep set (no sweeps key)")
    name, files = found
    specs = [load_spec(f, repetitions) for f in files]  # every member's checks before any work
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"sweep: the members of {name} must have distinct names (their directories); got {names}")
    root = Path(out) if out is not None else Path("runs") / f"sweep-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    summaries = [
        run_sweep(f, out=root / s.name, repetitions=repetitions, **kw) for f, s in zip(files, specs, strict=True)
    ]
    members = [(s, summary.pop("table_rows")) for s, summary in zip(specs, summaries, strict=True)]
    figures = [combined_figure(members, m, root / (m.replace(".", "_") + ".png")) for m in shared_metrics(specs)]
    if figures:
        print(f"sweep set {name}: {', '.join(str(f) for f in figures)} (the members side by side)")
    return {"out": str(root), "sweeps": summaries, "figures": [f.name for f in figures]}


def shared_metrics(specs: list[Any]) -> list[str]:
    """The metrics every member plots, in the first member's order."""
    return [m for m in specs[0].metrics if all(m in s.metrics for s in specs)]


def combined_figure(members: list[tuple[Any, list[dict[str, Any]]]], metric: str, path: Path) -> Path:
    """One panel per member (its own sweep figure's lines, reference lines and refusals), in rows of
    at most :data:`~fedpers.results.plots.PANELS_ACROSS` (never one long row)."""
    from fedpers.results.plots import _plt

    fig = members_figure(members, metric)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    _plt().close(fig)
    tmp.replace(path)
    return path


def members_figure(members: list[tuple[Any, list[dict[str, Any]]]], metric: str) -> Any:
    """:func:`combined_figure`'s figure (matplotlib), for a caller that saves it itself."""
    from fedpers.results.plots import panel_grid
    from fedpers.sweeps.run import draw_metric

    fig, axes = panel_grid(len(members), width=6.0, height=4.2)
    for ax, (spec, rows) in zip(axes, members, strict=True):
        draw_metric(ax, rows, spec, metric)
    fig.tight_layout()
    return fig
