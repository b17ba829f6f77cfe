"""A sweep run one point at a time and with ``--workers N`` on a local Ray, side by side.

Prints both wall times, the speed-up, and whether the two tables agree (1e-9 relative).

    PYTHONPATH=$PWD python benchmarks/sweep_parallel.py [--workers 2 --users 20000 --points 6]
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

from fedpers.sweeps.run import run_sweep


def table(out: Path) -> list[dict[str, str]]:
    with open(out / "table.csv") as f:
        return [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--users", type=int, default=20000)
    ap.add_argument("--points", type=int, default=6)
    a = ap.parse_args()
    seeds = ", ".join(str(i) for i in range(a.points))
    spec = f"""algorithm = "altmin"\nx = "seed"\nseries = "epsilon"\nmetrics = ["subspace_error"]
[base]\nn_users = {a.users}\ndim = 20\nrank = 3\nrounds = 2\nbaselines = "none"\n[grid]\nseed = [{seeds}]\n[plot]\nxscale = "linear"\n"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.toml"
        path.write_text(spec)
        t0 = time.perf_counter()
        run_sweep(path, out=Path(tmp) / "serial", progress=False)
        serial = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_sweep(path, out=Path(tmp) / "parallel", progress=False, workers=a.workers)
        parallel = time.perf_counter() - t0
        same = all(
            abs(float(x[k]) - float(y[k])) <= 1e-9 * max(1.0, abs(float(y[k])))
            for x, y in zip(table(Path(tmp) / "serial"), table(Path(tmp) / "parallel"))
            for k in x
            if k == "subspace_error"
        )
    print(
        f"{a.points} points of altmin n={a.users}, d=20, k=3: serial {serial:.1f} s, {a.workers} workers on a local Ray {parallel:.1f} s "
        f"(Ray start-up included); speed-up {serial / parallel:.2f}x; tables equal: {same}"
    )


if __name__ == "__main__":
    main()
