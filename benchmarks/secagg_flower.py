"""SecAgg+ over Flower Messages against central aggregation: one AltMin round in Flower's simulation.

For each number of nodes, three runs of the same tiny AltMin (2 users per node, d = 5, k = 2, every
user in each round, ε = 2) on Flower's Ray simulation, one after the other in this process:

- central: each node sends its clipped sums, the server adds them and the noise (``--dp-model central``);
- local: each node noises its units and sends its noisy sum (``--dp-model local``: node-side encoding,
  no secure aggregation);
- distributed: each node encodes, noises and masks its integer vector, in five Message stages per
  round (advertise keys, share keys, masked task, consistency, unmask; ``--dp-model distributed --bits 16``).

Timed: the steady round (the last of the run's rounds, from its record: the Ray start-up and the
nodes' first data loading fall in earlier ones), and the ratio of each to central's, measured side
by side in this run. The statistics here are small (W: 10, A: 55, b: 10 values), so the ratio is the
protocol's message and cryptography cost, not the arithmetic's.

    PYTHONPATH=$PWD python benchmarks/secagg_flower.py [--nodes 10,100] [--client-cpus 1] [--rounds 2]
        [--models central,local,distributed]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from fedpers import config as config_lib
from fedpers.app import run_flower
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy.accountant import Calibrations
from fedpers.runner import resolve

EXP = EXPERIMENTS["altmin"]
MODELS = ("central", "local", "distributed")


def one_run(nodes: int, model: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(seconds of the steady round, whole run's seconds, nodes that survived it) for one trust model."""
    fields = {"n_users": 2 * nodes, "dim": 5, "rank": 2, "samples_per_user": 16, "rounds": args.rounds,
              "cohorts": "all", "epsilon": 2.0, "seed": 0, "baselines": "none"}  # fmt: skip
    cfg = config_lib.build(EXP.config_type, fields)
    opts: dict[str, Any] = {"runtime": "flower", "nodes": nodes, "dp_model": model, "round_timeout": 3600.0,
                            "client_cpus": args.client_cpus}  # fmt: skip
    if model == "distributed":
        opts["bits"] = 16
    p = resolve(EXP, cfg, config_lib.build(RuntimeOptions, opts))
    table = p.calibrations.table
    node_protocol = EXP.protocol(p.cfg, Calibrations(table)) if model != "central" else None
    start = time.perf_counter()
    _, records = run_flower(EXP, p.cfg, p.protocol, p.privatizer, p.options, progress=False, calibrations=table,
                            node_protocol=node_protocol)  # fmt: skip
    total = time.perf_counter() - start
    last = records[-1]
    return last.seconds, total, int(last.diagnostics.get("nodes_survived", nodes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="10,100")
    p.add_argument("--rounds", type=int, default=2, help="AltMin rounds (the last one is timed)")
    p.add_argument("--client-cpus", type=float, default=1.0)
    p.add_argument("--models", default=",".join(MODELS), help="comma list of central, local, distributed")
    a = p.parse_args()
    models = [m for m in MODELS if m in a.models.split(",")]
    if "central" not in models or len(models) < 2:
        p.error("--models must hold central and at least one other (the ratios are to central)")
    print("seconds of one steady AltMin round on Flower's Ray simulation (whole run in brackets)")
    print(
        f"{'nodes':>6} {'central':>16} {'local':>16} {'distributed':>16} {'local/central':>14} {'SecAgg+/central':>16}"
    )
    for n in [int(v) for v in a.nodes.split(",")]:
        got: dict[str, tuple[float, float, int]] = {}
        for m in models:  # each printed as it finishes: a long run killed later keeps what it measured
            got[m] = one_run(n, m, a)
            print(f"  {n} nodes, {m}: steady round {got[m][0]:.2f} s (whole run {got[m][1]:.1f} s)", flush=True)
        if "distributed" in got:
            assert got["distributed"][2] == n, "every node should survive the timed round"
        cells = " ".join(f"{got[m][0]:>7.2f} ({got[m][1]:>6.1f})" if m in got else f"{'-':>16}" for m in MODELS)
        c = got["central"][0]
        ratios = " ".join(f"{got[m][0] / c:>14.1f}" if m in got else f"{'-':>14}" for m in ("local", "distributed"))
        print(f"{n:>6} {cells} {ratios}", flush=True)


if __name__ == "__main__":
    main()
