"""Deployment vs simulation vs local: one private AltMin round, measured in one run.

SuperLink + N SuperNodes (default 3) on 127.0.0.1 (insecure: loopback only), ``flwr run .
deployment``; Flower's Ray simulation with N nodes; the local runtime. Same config (30,000
users, d = 50, k = 3, m = 40, every user in each round, reproducible noise). The per-round
seconds come from each runtime's own round records (``rounds.jsonl`` for the deployment).
Target: a deployment round <= 3x the local round. Variants: ``cold`` (Flower's
default: a fresh ``flwr-clientapp`` process per message), ``warm`` (``flower-supernode
--isolation process`` + ``fedpers deploy superexec``: warm forked ClientApps), ``cached`` (+
``$FEDPERS_NODE_CACHE``), ``poll`` (one ``fedpers deploy supernode`` per node with the node
cache: what the README's recipe runs). The SuperNodes share this machine's cores, so each one's
ClientApps get ``cores // nodes`` torch threads (``OMP_NUM_THREADS``; ``--node-threads``), as Ray
gives each simulated node one CPU: three forks with two threads each on two cores take twice the
CPU of three with one thread each.

    PYTHONPATH=. python benchmarks/deployment_round.py [--users 30000 --rounds 2 --nodes 3 --node-threads 0 --variants cold,warm,cached,poll --no-simulation]

The deployment/local ratio as a curve (the issue's goal: a steady deployment round <= 1.5x the local
round): ``--variants poll --no-simulation --rounds 3 --users N`` for N = 30000, 100000, 200000 (it meets 1.5x from
about 200,000 users on the 2-core machine: docs/benchmarks.md).

SecAgg+'s cost in a deployment (``--trust-models central,distributed``: each variant under each trust
model, back to back, and each model's median steady round / central's in the same variant):
``--users 300 --dim 5 --rank 2 --samples 16 --variants poll,cold --trust-models central,distributed --rounds 3``
(the work is nil: the rounds are the exchanges' cost), and ``--users 30000 --dim 10 --rank 2`` where the round is
work. ``--keep DIR --flower-debug`` keeps every process's timestamped log: ``benchmarks/deployment_trace.py``
reads where an exchange's time goes (docs/benchmarks.md, "Deployment round").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from flower_support import Processes, start_loopback_federation, write_connection  # noqa: E402

from fedpers import config as config_lib  # noqa: E402
from fedpers.app import run_flower  # noqa: E402
from fedpers.experiments import EXPERIMENTS  # noqa: E402
from fedpers.privacy import Privatizer  # noqa: E402
from fedpers.runner import RuntimeOptions, split_seed  # noqa: E402
from fedpers.runtime.local import run_local  # noqa: E402

EXP = EXPERIMENTS["altmin"]

VARIANTS: dict[str, tuple[str, dict[str, bool]]] = {
    "cold": ("deployment", {}),
    "warm": ("deploy-warm", {"warm": True}),
    "cached": ("deploy-cached", {"warm": True, "cached": True}),
    "poll": ("deploy-poll", {"warm": True, "cached": True, "poll": True}),
}
"""Each ``--variants`` name → its row's name and :func:`deployment`'s switches."""


def fields(args: argparse.Namespace) -> dict:
    return {
        "n_users": args.users,
        "dim": args.dim,
        "rank": args.rank,
        "samples_per_user": args.samples,
        "rounds": args.rounds,
        "cohorts": "all",
        "seed": 0,
    }


def local(args: argparse.Namespace) -> list[float]:
    cfg, noise_seed = split_seed(config_lib.build(EXP.config_type, fields(args)))
    units = EXP.units(cfg, torch.arange(args.users))
    _, records = run_local(EXP.protocol(cfg), units, Privatizer(noise_seed), progress=False)
    return [r.seconds for r in records]


def simulation(args: argparse.Namespace) -> list[float]:
    cfg, noise_seed = split_seed(config_lib.build(EXP.config_type, fields(args)))
    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": args.nodes, "round_timeout": 3600.0})
    _, records = run_flower(EXP, cfg, EXP.protocol(cfg), Privatizer(noise_seed), opts, progress=False)
    return [r.seconds for r in records]


def deployment(
    args: argparse.Namespace,
    work: Path,
    warm: bool = False,
    cached: bool = False,
    poll: bool = False,
    trust: str = "central",
) -> list[float]:
    """``warm``: SuperNodes with ``--isolation process`` and ``fedpers deploy superexec`` beside each;
    ``cached``: also ``$FEDPERS_NODE_CACHE``, so a node loads its users once, not per message;
    ``poll``: ``fedpers deploy supernode`` alone (0.2 s polls; it starts ``fedpers deploy superexec``);
    ``trust``: the run-config's dp-model (distributed: 16 bits, SecAgg+ over the Messages; a node-side model
    needs secure noise, so its rounds are not reproducible)."""
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "OMP_NUM_THREADS": str(args.node_threads),
    }
    if cached:
        env["FEDPERS_NODE_CACHE"] = str(work / "node-cache")
    if args.flower_debug:
        env["FLWR_LOG_LEVEL"] = "DEBUG"  # Flower's public switch: every process logs with timestamps
    with Processes(work, env) as procs:
        port = start_loopback_federation(procs, work, args.nodes, warm=warm, poll=args.poll if poll else 0.0)
        write_connection(work / "cli-home", "deployment", f"127.0.0.1:{port}")
        out = work / "run"
        pairs = " ".join(f"{k}={json.dumps(v)}" for k, v in fields(args).items())
        model = f"dp-model='{trust}' bits=16 nodes={args.nodes}" if trust != "central" else "secure-noise=false"
        cmd = [
            shutil.which("flwr") or "flwr",
            "run",
            ".",
            "deployment",
            "--stream",
            "--run-config",
            f"config='{pairs}' out='{out}' round-timeout=3600.0 {model}",
        ]
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env={**env, "FLWR_HOME": str(work / "cli-home")},
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if done.returncode != 0 or not (out / "rounds.jsonl").is_file():
            raise SystemExit(
                f"deployment run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return [json.loads(line)["seconds"] for line in (out / "rounds.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=30_000)
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nodes", type=int, default=3, help="SuperNodes (and simulated nodes); the users are split evenly")
    p.add_argument(
        "--node-threads",
        type=int,
        default=0,
        help="torch threads per SuperNode's ClientApps (OMP_NUM_THREADS); 0 (default): the cores split between the nodes, at least 1 — "
        "co-located nodes with all cores each oversubscribe them (Ray gives each simulated node one CPU)",
    )
    p.add_argument("--poll", type=float, default=0.2, help="seconds between a SuperNode's pulls in the 'poll' variant")
    p.add_argument(
        "--trust-models",
        default="central",
        help="dp-models each variant runs under, side by side (central,distributed: SecAgg+'s cost; central first "
        "prints each other model's steady round / central's)",
    )
    p.add_argument(
        "--variants",
        default="cold,warm,cached,poll",
        help="deployments to run: cold (Flower's default), warm (fedpers deploy superexec), cached (warm + node cache), poll (cached + fedpers deploy supernode)",
    )
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep each deployment's directory (every process's log, rounds.jsonl) under this directory",
    )
    p.add_argument(
        "--flower-debug",
        action="store_true",
        help="FLWR_LOG_LEVEL=DEBUG in every deployment process: timestamped logs to trace a round (with --keep)",
    )
    p.add_argument(
        "--no-simulation",
        action="store_true",
        help="skip Flower's Ray simulation (deployments and the local runtime only)",
    )
    args = p.parse_args()
    args.node_threads = args.node_threads or max(1, (os.cpu_count() or 1) // args.nodes)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    trusts = [t.strip() for t in args.trust_models.split(",") if t.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r}; allowed: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="fedpers-deploy-bench-") as scratch:
        tmp = args.keep or scratch
        start = time.perf_counter()
        times: dict[str, list[float]] = {}
        for v in variants:  # each variant's trust models back to back, so a ratio compares runs close in time
            for trust in trusts:
                name = VARIANTS[v][0] + ("" if trust == "central" else f"/{trust}")
                times[name] = deployment(args, Path(tmp) / f"{v}-{trust}", **VARIANTS[v][1], trust=trust)
        if not args.no_simulation:
            times["simulation"] = simulation(args)
        times["local"] = local(args)
    print(
        f"{args.users} users, d={args.dim} k={args.rank} m={args.samples}, {args.nodes} nodes ({args.node_threads} torch threads each); seconds per round (all rounds)  [{time.perf_counter() - start:.0f} s total]"
    )
    for name, secs in times.items():
        print(f"{name:24s} " + "  ".join(f"{s:8.2f}" for s in secs))
    last = {k: v[-1] for k, v in times.items()}
    print(
        "last round / local (target <= 3x): "
        + ", ".join(f"{k} {v / last['local']:.1f}x" for k, v in last.items() if k != "local")
    )
    steady = {k: statistics.median(v[1:] or v) for k, v in times.items()}  # round 0 fills the node cache
    print(
        "median steady round (rounds >= 1) / local's (target <= 1.5x): "
        + ", ".join(
            f"{k} {v:.2f} s / {steady['local']:.2f} s = {v / steady['local']:.2f}x"
            for k, v in steady.items()
            if k != "local"
        )
    )
    for trust in trusts[1:] if trusts[:1] == ["central"] else []:
        print(
            f"median steady round, {trust} / central (target <= 2x): "
            + ", ".join(
                f"{VARIANTS[v][0]} {steady[VARIANTS[v][0] + '/' + trust]:.2f} s / {steady[VARIANTS[v][0]]:.2f} s"
                f" = {steady[VARIANTS[v][0] + '/' + trust] / steady[VARIANTS[v][0]]:.2f}x"
                for v in variants
            )
        )


if __name__ == "__main__":
    main()
