"""What Poisson sampling's amplification buys against disjoint cohorts, at equal (ε, δ), for AltMin.

Each point runs the same users (n, d, k, T) with: disjoint cohorts (each user in one of the T
rounds, parallel composition), Poisson sampling at q = 1/T (each round includes every user with
probability q; amplified, composed over T rounds with PLD), and every user in every round. Writes
``OUT/amplification.md`` (noise multiplier per release, subspace error mean ± s.e. over seeds) and
``OUT/amplification.png``.

    PYTHONPATH=$PWD python simulations/amplification.py OUT_DIR [SEEDS]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute

BASE = {"n_users": 60000, "dim": 10, "rank": 2, "samples_per_user": 16, "rounds": 3, "delta": 1e-5, "baselines": "none"}
EPSILONS = (1.0, 2.0, 4.0)
VARIANTS = {
    "disjoint": {"cohorts": "disjoint"},
    "poisson q=1/T": {"cohorts": "poisson", "sampling_rate": 1 / 3},
    "all users every round": {"cohorts": "all"},
}


def main() -> None:
    out = Path(sys.argv[1])
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    out.mkdir(parents=True, exist_ok=True)
    exp = EXPERIMENTS["altmin"]
    rows = []
    for eps in EPSILONS:
        for name, variant in VARIANTS.items():
            for seed in range(seeds):
                r = execute(
                    exp,
                    config.build(exp.config_type, {**BASE, **variant, "epsilon": eps, "seed": seed}),
                    write=False,
                    progress=False,
                )
                rows.append(
                    {
                        "epsilon": eps,
                        "variant": name,
                        "seed": seed,
                        "noise_multiplier": r["noise_multiplier"],
                        "epsilon_spent": r["epsilon"],
                        "subspace_error": r["subspace_error"],
                    }
                )
                with open(out / "runs.jsonl", "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
                print(json.dumps(rows[-1]), flush=True)
    lines = [
        "| ε | cohorts | noise multiplier z | ε spent (PLD) | subspace error (mean ± s.e.) |",
        "|---|---|---|---|---|",
    ]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in VARIANTS:
        means, ses = [], []
        for eps in EPSILONS:
            group = [r for r in rows if r["epsilon"] == eps and r["variant"] == name]
            vals = [r["subspace_error"] for r in group]
            mean = sum(vals) / len(vals)
            se = math.sqrt(sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1) / len(vals))
            means.append(mean)
            ses.append(se)
            lines.append(
                f"| {eps:g} | {name} | {group[0]['noise_multiplier']:.3f} | {max(r['epsilon_spent'] for r in group):.3f} | {mean:.4f} ± {se:.4f} |"
            )
        ax.errorbar(EPSILONS, means, yerr=[2 * s for s in ses], marker="o", capsize=3, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(EPSILONS, [f"{e:g}" for e in EPSILONS])
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("subspace error")
    ax.set_title(f"AltMin, n = {BASE['n_users']:,}, d = 10, k = 2, T = 3, m = 16; {seeds} seeds", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "amplification.png", dpi=130)
    (out / "amplification.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
