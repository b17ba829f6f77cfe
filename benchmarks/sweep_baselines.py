"""An ε sweep with every baseline against what it must cost: its private runs plus one baseline pass.

The sweep (``fedpers sweep``: AltMin, every baseline, ``--points`` values of ε at one data set and
seed; by default the shape of the speed figures, d = 100, k = 5, m = 40, float32) is timed in this process against, interleaved with it, ``--points`` private runs with
``--baselines none`` at the same values of ε plus one baseline pass (a run with every baseline minus
a run without, at one ε): the floor of a sweep that computes each non-private baseline once. Every
run writes its run directory, as a sweep's points do; a small sweep and run first pay the imports.
With ``--against OLD_TREE`` the same sweep is also timed on another tree (its fedpers, in a
subprocess, after the same warm-up), beside this one.

    PYTHONPATH=$PWD python benchmarks/sweep_baselines.py [--users 100000 --points 8 --dim 100 --rank 5 --samples 40]
    PYTHONPATH=$PWD python benchmarks/sweep_baselines.py --against OLD_TREE

Prints one JSON line: the seconds of each part (the minimum over ``--repeats``) and the ratios
sweep / (private runs + one baseline pass), before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def epsilons(points: int) -> list[float]:
    return [round(0.5 * 2 ** (i / 2), 4) for i in range(points)]  # 0.5 … about 5.7 for 8 points


def sweep_file(path: Path, args: argparse.Namespace) -> Path:
    spec = path / "sweep.toml"
    grid = ", ".join(str(e) for e in epsilons(args.points))
    spec.write_text(
        f'name = "eps"\nalgorithm = "altmin"\nx = "epsilon"\nseries = "n_users"\n'
        f'metrics = ["subspace_error", "baselines.nonprivate_altmin.excess_risk"]\n'
        f"[base]\nn_users = {args.users}\ndim = {args.dim}\nrank = {args.rank}\nsamples_per_user = {args.samples}\n"
        f'dtype = "float32"\nbaselines = "all"\n[grid]\nepsilon = [{grid}]\n'
    )
    return spec


def time_sweep(args: argparse.Namespace) -> float:
    from fedpers.sweeps.run import run_sweep

    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        spec = sweep_file(Path(tmp), args)
        start = time.perf_counter()
        run_sweep(spec, out=Path(tmp) / "out", progress=False)
        return time.perf_counter() - start


def time_run(args: argparse.Namespace, epsilon: float, baselines: str) -> float:
    from fedpers import config
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute

    exp = EXPERIMENTS["altmin"]
    values = dict(n_users=args.users, dim=args.dim, rank=args.rank, samples_per_user=args.samples, dtype="float32")
    cfg = config.build(exp.config_type, {**values, "epsilon": epsilon, "baselines": baselines})
    with tempfile.TemporaryDirectory(prefix="run-bench-") as tmp:
        start = time.perf_counter()
        execute(exp, cfg, out=Path(tmp) / "run", progress=False)
        return time.perf_counter() - start


def time_reference(args: argparse.Namespace) -> tuple[float, float]:
    """(the private runs without baselines, one baseline pass: every baseline minus none at one ε)."""
    private = sum(time_run(args, e, "none") for e in epsilons(args.points))
    every = time_run(args, epsilons(args.points)[0], "all")
    alone = time_run(args, epsilons(args.points)[0], "none")
    return private, every - alone


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=100_000)
    p.add_argument("--points", type=int, default=8)
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--rank", type=int, default=5)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--against", default="", help="another tree whose sweep is timed beside this one's")
    p.add_argument("--only-sweep", action="store_true", help="time the sweep alone (what --against runs)")
    args = p.parse_args()
    warm = argparse.Namespace(**{**vars(args), "users": 500, "points": 2})
    time_sweep(warm)  # imports, the plotting back end: paid once, before anything is timed
    time_run(warm, 1.0, "all")
    if args.only_sweep:
        print(json.dumps({"sweep_s": min(time_sweep(args) for _ in range(args.repeats))}))
        return
    best: dict[str, float] = {}
    flags = [f"--{k}={getattr(args, k)}" for k in ("users", "points", "dim", "rank", "samples")]
    for _ in range(args.repeats):
        parts = {"sweep_s": time_sweep(args)}
        parts["private_runs_s"], parts["baseline_pass_s"] = time_reference(args)
        if args.against:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.against, os.environ.get("PYTHONPATH", "")])}
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--only-sweep", *flags],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd=args.against,
            ).stdout
            parts["sweep_before_s"] = json.loads(out.splitlines()[-1])["sweep_s"]
        for k, v in parts.items():
            best[k] = min(best.get(k, float("inf")), v)
    floor = best["private_runs_s"] + best["baseline_pass_s"]
    report = {
        "users": args.users,
        "points": args.points,
        "dim": args.dim,
        "rank": args.rank,
        "samples": args.samples,
        **{k: round(v, 2) for k, v in best.items()},
        "ratio": round(best["sweep_s"] / floor, 2),
        **(
            {
                "ratio_before": round(best["sweep_before_s"] / floor, 2),
                "before_over_after": round(best["sweep_before_s"] / best["sweep_s"], 2),
            }
            if "sweep_before_s" in best
            else {}
        ),
        "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
