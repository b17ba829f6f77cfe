"""Start-up of a small run, side by side: this tree against another (``--against DIR``, e.g. a
``git worktree`` of origin/main), alternated, each a fresh ``fedpers`` process.

Prints, per tree, the medians of: wall time of ``fedpers run altmin --n-users 200 --out DIR``,
the work it reports (result.json's ``seconds``), wall minus reported (the goal: within 1 s), the
process's CPU seconds, and the wall time of a refused flag (``--n-user 5``) and a refused value
(``--epsilon -1``) (goal: under 0.5 s); then the ratios of the other tree's medians to this one's.

    PYTHONPATH=$PWD python benchmarks/startup.py --reps 7 --against /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(tree: Path, args: list[str], out: Path | None) -> tuple[float, float, float]:
    """(wall, reported, CPU) of ``fedpers ARGS`` run with ``tree`` first on the path."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedpers", *args], capture_output=True, env=env, cwd=tree, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    reported = float(json.loads((out / "result.json").read_text())["seconds"]) if out is not None else 0.0
    return wall, reported, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout to run alternately with this one")
    ns = parser.parse_args()
    trees = [ROOT] + ([ns.against.resolve()] if ns.against else [])
    rows: dict[Path, dict[str, list[float]]] = {t: {} for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(ns.reps):
            for i, tree in enumerate(trees if rep % 2 == 0 else trees[::-1]):
                out = Path(tmp) / f"r{rep}-{i}"
                wall, reported, cpu = one(
                    tree, ["run", "altmin", "--n-users", "200", "--quiet", "--out", str(out)], out
                )
                typo = one(tree, ["run", "altmin", "--n-user", "5"], None)[0]
                value = one(tree, ["run", "altmin", "--epsilon", "-1"], None)[0]
                row = {"wall": wall, "reported": reported, "outside": wall - reported, "cpu": cpu}
                for key, v in {**row, "misspelt flag": typo, "bad value": value}.items():
                    rows[tree].setdefault(key, []).append(v)
    print(f"medians of {ns.reps} runs each, alternated; load {os.getloadavg()[0]:.1f} at the end")
    keys = list(rows[ROOT])
    print(f"{'tree':40s}" + "".join(f"{k:>15s}" for k in keys))
    for tree in trees:
        print(f"{tree!s:40s}" + "".join(f"{statistics.median(rows[tree][k]):14.2f}s" for k in keys))
    if ns.against:
        other = trees[1]
        print(
            f"{'ratio other / this':40s}"
            + "".join(
                f"{statistics.median(rows[other][k]) / max(statistics.median(rows[ROOT][k]), 1e-9):14.2f}x"
                for k in keys
            )
        )


if __name__ == "__main__":
    main()
