"""The audit table of docs/audit.md: proven ε beside the empirical bounds, per algorithm and ε.

    python benchmarks/audit_table.py altmin:4 fedrep:4 ...   # ALGO:EPSILON[:CANARIES[:RUNS[:PLACEMENT[:RELEASES]]]]

RELEASES: statistic names joined by "+" (e.g. W+b): only those releases are scored, against the
proven ε of those releases alone.

Each row: ≈1,000 canary trials (canaries per run × runs), the algorithm's defaults otherwise,
seed 0; wall time of the audit itself (one process, one thread)."""

from __future__ import annotations

import sys
import time

from fedpers import config as config_lib
from fedpers.commands.audit import audit
from fedpers.experiments import experiment

DEFAULTS = {  # canaries per run (the design's orthogonal capacity at the defaults), runs
    "altmin": (10, 100, {}),
    "fedrep": (8, 125, {}),
    "noisygd": (50, 20, {"accountant": "pld"}),
    "dpals": (
        100,
        10,
        {"private_center": False, "n_items": 300, "clip_embedding": 3.0, "clip_rating": 3.0, "ridge_item": 1.0},
    ),
    "noisyhead": (25, 40, {"mode": "rounds", "calibration": "accountant"}),
}


def row(spec: str) -> str:
    name, eps, *rest = spec.split(":")
    k, runs, extra = DEFAULTS[name]
    if rest:
        k = int(rest[0])
    if len(rest) > 1:
        runs = int(rest[1])
    placement = rest[2] if len(rest) > 2 else "auto"
    releases = tuple(rest[3].split("+")) if len(rest) > 3 else None
    exp = experiment(name)
    cfg = config_lib.build(exp.config_type, {**extra, "epsilon": float(eps)})
    start = time.perf_counter()
    r = audit(exp, cfg, k, runs=runs, seed=0, placement=placement, releases=releases)
    took = time.perf_counter() - start
    g = r["gaussian_score"]
    label = name + (f" ({placement} placement)" if placement not in ("auto", "orthogonal") else "")
    if releases is not None:
        label += f", {' and '.join(releases)} alone (run ε {r['run_proven_epsilon']:.3g})"
    return (
        f"| {label} | {r['proven_epsilon']:.3g} (μ {r['proven_mu']:.3f}) | {r['canary_mu']:.3f} | {r['epsilon_lower']:.2f} | "
        f"{r['independent_gdp']['epsilon_lower']:.2f} | {g['epsilon']:.2f} (μ̂ {g['mu']:.3f}) | {g['epsilon_lower']:.2f} | "
        f"{r['trials']} ({k} × {runs}) | {took:.0f} s |"
    )


if __name__ == "__main__":
    print(
        "| algorithm | proven ε | canaries' μ | any mechanism | independent GDP | Gaussian-score ε (μ̂) | Gaussian-score ε ≥ | trials | time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in sys.argv[1:]:
        print(row(spec), flush=True)
