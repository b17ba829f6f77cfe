"""AltMin's client statistics against a GEMM of their flops, this tree and another checkout side by side.

Runs ``benchmarks.altmin_round.statistics_vs_gemm`` of each tree alternately in one process (the
modules are imported afresh from each tree), so both see the same machine; prints each tree's
best time, the best GEMM time of the run and the ratios. For a before/after of a change:

    git worktree add /tmp/base origin/main
    PYTHONPATH=$PWD python benchmarks/statistics_against.py --against /tmp/base [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load(root: Path) -> Callable[..., tuple[float, float, float]]:
    """``statistics_vs_gemm`` with fedpers and benchmarks imported from ``root``."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("fedpers", "benchmarks")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        import benchmarks.altmin_round as altmin_round
    finally:
        sys.path.pop(0)
    return altmin_round.statistics_vs_gemm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="another checkout (e.g. a git worktree of origin/main)")
    ap.add_argument("--users", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    trees = {"this": load(ROOT), "other": load(args.against.resolve())}
    for dtype in (torch.float32, torch.float64):
        best: dict[str, float] = {}
        for _ in range(args.reps):  # alternately; the minimum of each (a shared machine slows all alike)
            for name, fn in trees.items():
                fused, _, gemm = fn(args.users, 100, 5, 40, 4096, dtype, reps=1)
                best[name] = min(best.get(name, float("inf")), fused)
                best["gemm"] = min(best.get("gemm", float("inf")), gemm)
        print(
            f"{str(dtype)[6:]}: statistics this {best['this']:.3f} s, other {best['other']:.3f} s, GEMM {best['gemm']:.3f} s "
            f"-> statistics/GEMM this {best['this'] / best['gemm']:.2f}x, other {best['other'] / best['gemm']:.2f}x; "
            f"this/other {best['this'] / best['other']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
