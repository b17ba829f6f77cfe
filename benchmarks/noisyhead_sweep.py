"""Benchmark: the full §6.1 low-dimensional NoisyHead grid (7 N × 5 ε × B = 500), host and device paths.

Run: ``PYTHONPATH=. python benchmarks/noisyhead_sweep.py [--repetitions 500] [--device cpu|cuda]
[--kernels host,device] [--loop-reps 0]``; the issue's GPU goal (the grid in under 30 s on one
H100) is ``python benchmarks/noisyhead_sweep.py --device cuda --kernels device``.

1. batched: ``sweep_point(cfg, B)`` for every grid point, as ``fedpers sweep`` calls it (the
   data statistics of one N are shared by its five ε), once per code path in ``--kernels``
   (``host``: drawn and computed on the CPU; ``device``: drawn, reduced and stepped on
   ``--device``; see docs/noisyhead.md), side by side in this one process, taking turns at
   each N.
2. with ``--loop-reps k > 0``, per-repetition loops on a subset (k seeds at every N, ε = 1),
   projected to the full grid (35 points × B):
   - ``execute``: one ordinary run per seed (``runner.execute``), what the sweep does for an
     experiment without ``sweep_point``;
   - ``sweep_point(B=1)``: the batched code called once per repetition (vectorisation alone).

Prints the measured times and the ratios (all measured in this one run) and the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import tomllib
from pathlib import Path

import torch

from fedpers import config as config_lib
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.noisyhead import montecarlo, sweep
from fedpers.runner import execute

TOML = Path(__file__).resolve().parent.parent / "simulations" / "noisyhead_lowdim.toml"
GPU_TARGET_S = 30.0


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (torch {torch.__version__})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.1f} (torch {torch.__version__})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=500)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument(
        "--kernels", default="host,device", help="comma list of code paths to time side by side: host, device, auto"
    )
    parser.add_argument(
        "--loop-reps", type=int, default=0, help="repetitions per N in the per-repetition loops (0: none)"
    )
    args = parser.parse_args()
    spec = tomllib.loads(TOML.read_text())
    exp = EXPERIMENTS["noisyhead"]
    Ns, epsilons = spec["grid"]["prompts"], spec["grid"]["epsilon"]
    B = args.repetitions
    paths = [k.strip() for k in args.kernels.split(",") if k.strip()]

    def cfg_for(n: int, eps: float, kernels: str, seed: int = 0):
        base = {**spec["base"], "prompts": n, "epsilon": eps, "seed": seed, "device": args.device, "kernels": kernels}
        return config_lib.build(exp.config_type, base)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    print(f"§6.1 low-dim grid: N ∈ {Ns}, ε ∈ {epsilons}, B = {B} ({len(Ns) * len(epsilons)} points)")
    print(f"machine: {machine(args.device)}")
    exp.sweep_point(cfg_for(Ns[0], 1.0, paths[0], seed=999), 2)  # warm-up: imports, first calls, CUDA context
    accounting = [0.0]  # the PLD accountant's share (CPU, the same on every path and device)
    ledger_epsilon = sweep.ledger_epsilon

    def timed_epsilon(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return ledger_epsilon(*a, **k)
        finally:
            accounting[0] += time.perf_counter() - t

    sweep.ledger_epsilon = timed_epsilon  # type: ignore[assignment]
    totals = dict.fromkeys(paths, 0.0)
    accounted = dict.fromkeys(paths, 0.0)
    for n in Ns:  # the paths take turns at each N, so both see the same load
        for kernels in paths:
            montecarlo._CACHE.clear()
            sync()
            t0, a0 = time.perf_counter(), accounting[0]
            for eps in epsilons:
                rows = exp.sweep_point(cfg_for(n, eps, kernels), B)
                assert len(rows) == B
            sync()
            took = time.perf_counter() - t0
            totals[kernels] += took
            accounted[kernels] += accounting[0] - a0
            print(f"  {kernels:6s} N={n:5d}: {took:7.2f} s for {len(epsilons)} ε × {B} repetitions")
    for kernels, total in totals.items():
        on = "cpu" if kernels == "host" or (kernels == "auto" and not args.device.startswith("cuda")) else args.device
        line = f"{kernels} path ({on}): full grid {total:.1f} s, of which the PLD accountant {accounted[kernels]:.1f} s"
        if on.startswith("cuda"):
            met = "met" if total < GPU_TARGET_S else "MISSED"
            line += f"  (goal < {GPU_TARGET_S:.0f} s on one H100: {met})"
        print(line)
    if "host" in totals:
        for kernels, t in totals.items():
            if kernels != "host":
                print(f"host / {kernels} = {totals['host'] / t:.2f} (same process, same load)")

    if args.loop_reps <= 0:
        return
    loops = {"execute": 0.0, "sweep_point(B=1)": 0.0}
    execute(exp, cfg_for(Ns[0], 1.0, "host", seed=999), write=False, progress=False)
    for n in Ns:
        for name in loops:
            t0 = time.perf_counter()
            for seed in range(args.loop_reps):
                cfg = cfg_for(n, 1.0, "host", seed=1000 + seed)
                if name == "execute":
                    execute(exp, cfg, write=False, progress=False)
                else:
                    montecarlo._CACHE.clear()
                    exp.sweep_point(cfg, 1)
            per_rep = (time.perf_counter() - t0) / args.loop_reps
            loops[name] += per_rep * len(epsilons) * B  # projected time of this N's grid points
            print(f"  loop {name:17s} N={n:5d}: {per_rep:6.3f} s per repetition")
    batched = totals.get("host", next(iter(totals.values())))
    for name, projected in loops.items():
        print(
            f"per-repetition loop ({name}): projected full grid {projected:.0f} s ({projected / 3600:.2f} h); "
            f"batched is {projected / batched:.1f}x faster"
        )


if __name__ == "__main__":
    main()
