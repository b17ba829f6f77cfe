"""Benchmark: the full §6.1 low-dimensional NoisyHead grid (7 N × 5 ε × B = 500), batched vs a loop.

Run: ``PYTHONPATH=. python benchmarks/noisyhead_sweep.py [--repetitions 500] [--loop-reps 5]``

1. batched: ``NoisyHeadExperiment.sweep_point(cfg, B)`` for every grid point, as ``fedpers sweep``
   calls it (the data statistics of one N are shared by its five ε).
2. per-repetition loops on a subset (``--loop-reps`` seeds at every N, ε = 1), projected to the
   full grid (35 points × B):
   - ``execute``: one ordinary run per seed (``runner.execute``), what the sweep does for an
     experiment without ``sweep_point``;
   - ``sweep_point(B=1)``: the batched code called once per repetition (vectorisation alone).

Prints the measured times, the projections, and the ratios (all measured in this one run).
Target: batched full grid under 10 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import time
import tomllib
from dataclasses import replace
from pathlib import Path

from fedpers import config as config_lib
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments import noisyhead_mc
from fedpers.runner import execute

TOML = Path(__file__).resolve().parent.parent / "simulations" / "noisyhead_lowdim.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=500)
    parser.add_argument("--loop-reps", type=int, default=5, help="repetitions per N in the per-repetition loops")
    args = parser.parse_args()
    spec = tomllib.loads(TOML.read_text())
    exp = EXPERIMENTS["noisyhead"]
    Ns, epsilons = spec["grid"]["prompts"], spec["grid"]["epsilon"]
    B = args.repetitions

    def cfg_for(n: int, eps: float, seed: int = 0):
        return config_lib.build(exp.config_type, {**spec["base"], "prompts": n, "epsilon": eps, "seed": seed})

    print(f"§6.1 low-dim grid: N ∈ {Ns}, ε ∈ {epsilons}, B = {B} ({len(Ns) * len(epsilons)} points)")
    noisyhead_mc._CACHE.clear()
    start = time.perf_counter()
    per_n: dict[int, float] = {}
    for n in Ns:
        t0 = time.perf_counter()
        for eps in epsilons:
            rows = exp.sweep_point(cfg_for(n, eps), B)
            assert len(rows) == B
        per_n[n] = time.perf_counter() - t0
        print(f"  batched  N={n:5d}: {per_n[n]:7.1f} s for {len(epsilons)} ε × {B} repetitions")
    batched = time.perf_counter() - start
    print(f"batched full grid: {batched:.1f} s ({batched / 60:.2f} min)  target < 10 min: {'met' if batched < 600 else 'MISSED'}")

    loops = {"execute": 0.0, "sweep_point(B=1)": 0.0}
    execute(exp, cfg_for(Ns[0], 1.0, seed=999), write=False, progress=False)  # warm-up: imports, first calls
    for n in Ns:
        for name in loops:
            t0 = time.perf_counter()
            for seed in range(args.loop_reps):
                cfg = cfg_for(n, 1.0, seed=1000 + seed)
                if name == "execute":
                    execute(exp, cfg, write=False, progress=False)
                else:
                    noisyhead_mc._CACHE.clear()
                    exp.sweep_point(cfg, 1)
            per_rep = (time.perf_counter() - t0) / args.loop_reps
            loops[name] += per_rep * len(epsilons) * B  # projected time of this N's grid points
            print(f"  loop {name:17s} N={n:5d}: {per_rep:6.3f} s per repetition")
    for name, projected in loops.items():
        print(f"per-repetition loop ({name}): projected full grid {projected:.0f} s ({projected / 3600:.2f} h); "
              f"batched is {projected / batched:.1f}x faster")


if __name__ == "__main__":
    main()
