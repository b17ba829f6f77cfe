"""Every benchmark's ratio, side by side, in one process: ``python -m benchmarks [--full] [--flower]``.

Each row times a fedpers computation and its reference interleaved in this process (on a shared
machine a neighbour slows both alike), and prints the ratio; a ratio is the figure to quote, never
one of its times alone. The quick size (the default, about two minutes on 2 cores) is for a check
that nothing regressed; ``--full`` runs the sizes docs/benchmarks.md quotes. The table is also
written, dated, to ``--table`` (default docs/benchmark-table.md, which docs/benchmarks.md quotes).

Rows: AltMin with every baseline against ``--baselines none``; a whole AltMin run against a GEMM of
its flops plus a draw of its normals; the client statistics against a GEMM of their flops (float32,
float64); one DPALS step against a GEMM of its flops; a 200-user run's wall time against the work it
reports (start-up); with ``--flower``, one ClientApp call against an empty ClientApp under bare
Flower and a SecAgg+ round against a central round at 100 nodes (1,000 too with ``--full``) on Flower's
simulation (starts Ray: flwr and ray must be installed).

    PYTHONPATH=$PWD python -m benchmarks            # quick
    PYTHONPATH=$PWD python -m benchmarks --full     # 10^5 and 10^6 users, MovieLens-20M's DPALS shape
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    name: str
    size: str
    measured: float
    reference: float
    what: str  # what the reference is
    goal: str = ""

    @property
    def ratio(self) -> float:
        return self.measured / self.reference if self.reference > 0 else float("inf")


def _load() -> float:
    return os.getloadavg()[0]


def baselines_ratio(n: int, d: int, repeats: int) -> Row:
    """AltMin, every baseline, against the same run with ``--baselines none`` (runs interleaved, minima)."""
    from fedpers import config
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute

    exp = EXPERIMENTS["altmin"]
    times: dict[str, list[float]] = {"none": [], "all": []}
    for _ in range(repeats):
        for b in ("none", "all"):
            cfg = config.build(
                exp.config_type,
                dict(n_users=n, dim=d, rank=5, samples_per_user=40, rounds=2, dtype="float32", baselines=b),
            )
            t = time.perf_counter()
            execute(exp, cfg, write=False, progress=False)
            times[b].append(time.perf_counter() - t)
    return Row(
        "AltMin: every baseline / --baselines none",
        f"n={n:,} d={d} k=5 m=40 T=2 float32",
        min(times["all"]),
        min(times["none"]),
        "the same run, --baselines none",
        "≤ 1.5",
    )


def floor_ratio(n: int) -> Row:
    """A whole AltMin run (no baselines) against a GEMM of its flops plus a draw of its normals."""
    from benchmarks import altmin_run

    args = argparse.Namespace(
        dim=100, rank=5, samples=40, rounds=2, dtype="float32", device="cpu", kernels="auto", seed=0
    )
    run, _ = altmin_run.whole_run(n, args)
    frac = 1.0 / args.rounds
    gemm = altmin_run.gemm_time(altmin_run.run_flops(n, 40, 100, 5, 2, frac), torch.float32, "cpu")
    draw = altmin_run.draw_time(altmin_run.run_normals(n, 40, 100, 5, 2, frac), torch.float32, "cpu")
    return Row(
        "AltMin run / floor",
        f"n={n:,} d=100 k=5 m=40 T=2 float32",
        run,
        gemm + draw,
        "GEMM of its flops + randn of its normals",
    )


def statistics_ratio(n: int, dtype: torch.dtype) -> Row:
    """The client statistics of a round against a GEMM of their tight flop count (minima of 3 interleaved)."""
    from benchmarks import altmin_round

    fused, _, gemm = altmin_round.statistics_vs_gemm(n, 100, 5, 40, 4096, dtype, reps=3)
    name = str(dtype).split(".")[-1]
    return Row(
        f"client statistics / GEMM ({name})", f"{n:,} users d=100 k=5 m=40", fused, gemm, "GEMM of their flops", "≤ 2"
    )


def dpals_ratio(full: bool) -> Row:
    """One DPALS step (benchmarks/dpals_step.py) against a GEMM of its flops, from the script's own lines."""
    from benchmarks import dpals_step

    argv = [] if full else ["--users", "13800", "--ratings", "2000000"]
    out = io.StringIO()
    saved = sys.argv
    sys.argv = ["dpals_step", *argv]
    try:
        with contextlib.redirect_stdout(out):
            dpals_step.main()
    finally:
        sys.argv = saved
    text = out.getvalue()
    step = float(_find(r"whole step: ([0-9.]+) s", text))
    gemm = float(_find(r"of equal flops \([0-9.]+ GFLOP\): ([0-9.]+) s", text))
    size = (
        "MovieLens-20M shape (138,000 users, 20 M ratings)"
        if full
        else "a tenth of MovieLens-20M (13,800 users, 2 M ratings)"
    )
    return Row("DPALS step / GEMM", size, step, max(gemm, 1e-9), "GEMM of its flops", "step < 4 s (full shape)")


def startup_ratio() -> Row:
    """A 200-user run's wall time (a fresh process) against the work it reports ("completed in")."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "fedpers",
            "run",
            "altmin",
            "--n-users",
            "200",
            "--baselines",
            "none",
            "--quiet",
            "--out",
            str(Path(tmp) / "r"),
        ]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=tmp)
        wall = time.perf_counter() - t
        reported = float(json.loads((Path(tmp) / "r" / "result.json").read_text())["seconds"])
    return Row(
        "start-up: wall / reported work",
        "fedpers run altmin --n-users 200 --baselines none",
        wall,
        reported,
        "the run's own 'completed in'",
        "wall within 1 s of the work",
    )


def flower_ratio(nodes: int) -> Row:
    """One ClientApp call against an empty ClientApp under bare Flower (benchmarks/flower_overhead.py)."""
    from benchmarks import flower_overhead

    args = argparse.Namespace(
        dim=50,
        rank=3,
        samples=40,
        client_cpus=1.0,
        client_gpus=0.0,
        sim_gpus=-1,
        device="cpu",
        ray_address="",
        steady_rounds=3,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        flower_overhead.per_call([nodes], args)
    line = [ln for ln in out.getvalue().splitlines() if ln.split()[:2] == [str(nodes), "wall"]][-1]
    fed, bare = (float(v) for v in re.findall(r"([0-9.]+) ms", line)[:2])
    return Row(
        "Flower: ClientApp call / empty ClientApp", f"{nodes} nodes, one user each", fed, bare, "bare Flower", "≤ 1.25"
    )


def secagg_ratio(nodes: int) -> Row:
    """A steady SecAgg+ round (``--dp-model distributed``, 16 bits) against a steady central round: the same
    tiny AltMin on Flower's simulation, one run after the other (benchmarks/secagg_flower.py)."""
    from benchmarks import secagg_flower

    args = argparse.Namespace(rounds=2, client_cpus=1.0)
    central = secagg_flower.one_run(nodes, "central", args)[0]
    secure = secagg_flower.one_run(nodes, "distributed", args)[0]
    return Row(
        "Flower: SecAgg+ round / central round",
        f"{nodes:,} nodes, AltMin 2 users each (d=5, k=2)",
        secure,
        central,
        "the same round, --dp-model central",
        "≤ 3 (1,000 nodes)",
    )


def _find(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"benchmark output lacks {pattern!r}:\n{text}")
    return found.group(1)


def table(rows: list[Row], started: str, loads: list[float], full: bool) -> str:
    lines = [
        f"# Benchmark table · {started}",
        "",
        f"`python -m benchmarks{' --full' if full else ''}` (one process, every row's two times measured side by side; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {min(loads):.1f}–{max(loads):.1f} during the run). "
        "Quote the ratios: on a shared machine the times move with the neighbours.",
        "",
        "| benchmark | size | measured | reference | ratio | goal |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.size} | {r.measured:.3g} s | {r.reference:.3g} s ({r.what}) | **{r.ratio:.2f}×** | {r.goal} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--full", action="store_true", help="the sizes docs/benchmarks.md quotes (tens of minutes on 2 cores)"
    )
    ap.add_argument(
        "--flower", action="store_true", help="also the Flower rows: per-call cost, SecAgg+/central (starts Ray)"
    )
    ap.add_argument(
        "--table", default=str(ROOT / "docs" / "benchmark-table.md"), help="where the dated table goes ('' : nowhere)"
    )
    a = ap.parse_args(argv)
    from fedpers.memory import reuse_freed_memory

    reuse_freed_memory()  # the fedpers command's malloc policy, so runs here cost what a run costs
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    jobs: list[Callable[[], Row]] = []
    if a.full:
        jobs += [lambda: baselines_ratio(100_000, 100, 1), lambda: baselines_ratio(1_000_000, 100, 1)]
        jobs += [lambda: floor_ratio(100_000), lambda: statistics_ratio(20_000, torch.float32)]
        jobs += [lambda: statistics_ratio(20_000, torch.float64), lambda: dpals_ratio(True)]
    else:
        jobs += [lambda: baselines_ratio(20_000, 50, 1), lambda: floor_ratio(20_000)]
        jobs += [lambda: statistics_ratio(4096, torch.float32), lambda: statistics_ratio(4096, torch.float64)]
        jobs += [lambda: dpals_ratio(False)]
    jobs.append(startup_ratio)
    if a.flower:
        jobs += [lambda: flower_ratio(100)] + ([lambda: flower_ratio(500)] if a.full else [])
        jobs += [lambda: secagg_ratio(100)] + ([lambda: secagg_ratio(1000)] if a.full else [])
    rows: list[Row] = []
    loads = [_load()]
    for job in jobs:
        rows.append(job())
        loads.append(_load())
        r = rows[-1]
        print(f"{r.name:48s} {r.ratio:8.2f}×   ({r.measured:.3g} s / {r.reference:.3g} s; {r.size})", flush=True)
    text = table(rows, started, loads, a.full)
    print("\n" + text)
    if a.table:
        Path(a.table).write_text(text)
        print(f"written: {a.table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
