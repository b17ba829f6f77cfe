"""The trust-model figure: private error of AltMin and FedRep under central, distributed (Skellam under
a modular secure sum, b bits) and local DP, with the non-private baseline (docs/privacy.md, "Three trust
models").

    python simulations/trust_models.py OUT_DIR [--seeds 5] [--epsilons 1,2,4,8] [--bits 8,12,16,20] [--algorithms altmin]

Writes OUT_DIR/runs.jsonl (one line per run, appended as each finishes, so a killed sweep keeps what it
ran; a rerun skips the lines already there), OUT_DIR/table.md (medians over seeds, with the modular-wrap
count) and OUT_DIR/trust_models.png. The grid is the sweep set simulations/trust_models.toml (whose
`fedpers sweep` runs the same points without the non-private baseline, b = 8 and the wrap count).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute
from fedpers.runtime.options import RuntimeOptions

HERE = Path(__file__).parent


def models(bits: list[int]) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("central", {}),
        *[(f"distributed b={b}", {"dp_model": "distributed", "bits": b}) for b in bits],
        ("local", {"dp_model": "local"}),
    ]


def run_one(
    algorithm: str, base: dict[str, Any], epsilon: float, seed: int, options: dict[str, Any], nodes: int
) -> dict[str, Any]:
    exp = EXPERIMENTS[algorithm]
    cfg = config.build(exp.config_type, {**base, "epsilon": epsilon, "seed": seed})
    opts = config.build(RuntimeOptions, {"nodes": nodes, **options})
    start = time.perf_counter()
    out = execute(exp, cfg, opts, write=False, progress=False)
    wraps = sum(int(r.get("modular_wraps", 0)) for r in out["_rounds"])
    return {
        "subspace_error": out["subspace_error"],
        "epsilon_spent": out["privacy"]["epsilon"],
        "modular_wraps": wraps,
        "seconds": time.perf_counter() - start,
    }


def grid() -> dict[str, Any]:
    """The grid of the sweep set simulations/trust_models.toml (one sweep per algorithm), as this script
    runs it: each algorithm's fixed fields, the ε values, the repetitions as seeds, the nodes, and the
    bits of its distributed series plus b = 8 (which the sweeps leave out: refused at n = 4000)."""
    from fedpers.sweeps.sets import sweep_set
    from fedpers.sweeps.spec import load_spec

    found = sweep_set(HERE / "trust_models.toml")
    assert found is not None, "simulations/trust_models.toml must be a sweep set"
    specs = [load_spec(f) for f in found[1]]
    runtime = {"nodes", "dp_model", "bits", "min_nodes"}
    bits = {int(o["bits"]) for s in specs for o in s.series_values.values() if "bits" in o}
    return {
        "seeds": max(s.repetitions for s in specs),
        "epsilons": sorted({float(e) for s in specs for e in s.grid["epsilon"]}),
        "bits": sorted(bits | {8}),
        "nodes": int(specs[0].base.get("nodes", 8)),
        "algorithms": {s.algorithm: {k: v for k, v in s.base.items() if k not in runtime} for s in specs},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--epsilons", default=None)
    p.add_argument("--bits", default=None)
    p.add_argument("--algorithms", default=None, help="comma list (default: every algorithm of the toml)")
    a = p.parse_args(argv)
    spec = grid()
    seeds = a.seeds or int(spec["seeds"])
    epsilons = [float(e) for e in a.epsilons.split(",")] if a.epsilons else [float(e) for e in spec["epsilons"]]
    bits = [int(b) for b in a.bits.split(",")] if a.bits else [int(b) for b in spec["bits"]]
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "runs.jsonl"
    done = (
        {
            (d["algorithm"], d["model"], d["epsilon"], d["seed"])
            for d in (json.loads(line) for line in log.read_text().splitlines() if line.strip())
        }
        if log.exists()
        else set()
    )
    for seed in range(seeds):  # seeds outer: a killed sweep has every cell at fewer seeds
        for algorithm, base in spec["algorithms"].items():
            if a.algorithms and algorithm not in a.algorithms.split(","):
                continue
            cells = [("non-private", {}, math.inf)] + [(m, o, e) for e in epsilons for m, o in models(bits)]
            for model, options, eps in cells:
                key = (algorithm, model, eps if math.isfinite(eps) else "inf", seed)
                if key in done:
                    continue
                try:
                    row = run_one(algorithm, base, eps, seed, options, int(spec["nodes"]))
                except ValueError as e:  # e.g. too few bits for the sum of n units: refused before any release
                    row = {"refused": str(e)}
                line = {"algorithm": algorithm, "model": model, "epsilon": key[2], "seed": seed, **row}
                with log.open("a") as f:
                    f.write(json.dumps(line) + "\n")
                print(json.dumps(line), file=sys.stderr, flush=True)
    summarise(log, a.out)


def summarise(log: Path, out: Path) -> None:
    """Median subspace error per (algorithm, model, ε) over seeds: table.md and trust_models.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    rows = [r for r in every if "refused" not in r]
    refused = sorted({(r["algorithm"], r["model"], r["refused"]) for r in every if "refused" in r})
    cells: dict[tuple[str, str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["algorithm"], r["model"], r["epsilon"]), []).append(r)
    algorithms = sorted({r["algorithm"] for r in rows})
    lines = [
        "| algorithm | trust model | ε | seeds | median subspace error | vs central | modular wraps |",
        "|---|---|---|---|---|---|---|",
    ]
    fig, axes = plt.subplots(1, len(algorithms), figsize=(5.5 * len(algorithms), 4), squeeze=False)
    for ax, algorithm in zip(axes[0], algorithms, strict=True):
        ms = sorted({m for (al, m, e) in cells if al == algorithm and m != "non-private"}, key=_model_order)
        for m in ms:
            eps = sorted(e for (al, mm, e) in cells if al == algorithm and mm == m)
            med = [statistics.median(r["subspace_error"] for r in cells[(algorithm, m, e)]) for e in eps]
            ax.plot(eps, med, marker="o", label=m)
            for e, v in zip(eps, med, strict=True):
                central = cells.get((algorithm, "central", e))
                ref = statistics.median(r["subspace_error"] for r in central) if central else float("nan")
                wraps = sum(r["modular_wraps"] for r in cells[(algorithm, m, e)])
                lines.append(
                    f"| {algorithm} | {m} | {e:g} | {len(cells[(algorithm, m, e)])} | {v:.4f} | {v / ref:.3f} | {wraps} |"
                )
        npriv = cells.get((algorithm, "non-private", "inf"))
        if npriv:
            v = statistics.median(r["subspace_error"] for r in npriv)
            ax.axhline(v, color="k", ls="--", label="non-private")
            lines.append(f"| {algorithm} | non-private | inf | {len(npriv)} | {v:.4f} | | 0 |")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ε (δ = 1e-5)")
        ax.set_ylabel("subspace error (median over seeds)")
        ax.set_title(algorithm)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "trust_models.png", dpi=120)
    lines += [f"\n{al}, {m}: refused before any release: {why}" for al, m, why in refused]
    (out / "table.md").write_text("\n".join(lines) + "\n")


def _model_order(m: str) -> tuple[int, int]:
    if m == "central":
        return (0, 0)
    if m.startswith("distributed"):
        return (1, int(m.split("=")[1]))
    return (2, 0)


if __name__ == "__main__":
    main()
