"""Median and inter-quartile range per ε of run_private_fedrep_seed_major.py's JSON lines, as a
Markdown table, and the figure (population MSE vs ε, both methods, IQR bands).

    python simulations/summarise_private_fedrep.py RUNS.jsonl [FIGURE.png]
"""

import json
import sys

import numpy as np

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
eps = sorted({r["epsilon"] for r in rows})
methods = {"fedrep": "Private FedRep", "priv_altmin": "Priv-AltMin", "init_only": "private init only"}
stats = {m: [] for m in methods}
print("| ε | seeds | " + " | ".join(methods.values()) + " |")
print("|---|---|" + "---|" * len(methods))
for e in eps:
    group = [r for r in rows if r["epsilon"] == e]
    cells = []
    for m in methods:
        a = np.array([r[m] for r in group])
        q = np.quantile(a, [0.25, 0.5, 0.75])
        stats[m].append(q)
        cells.append(f"{q[1]:.4f} [{q[0]:.4f}, {q[2]:.4f}]")
    print(f"| {e:g} | {len(group)} | " + " | ".join(cells) + " |")
oracle = np.median([r["oracle"] for r in rows])
print(f"\noracle (U*): {oracle:.2e}")
if len(sys.argv) > 2:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for m, label in methods.items():
        q = np.array(stats[m])
        ax.plot(eps, q[:, 1], marker="o", label=label)
        ax.fill_between(eps, q[:, 0], q[:, 2], alpha=0.25)
    ax.axhline(oracle, color="gray", ls="--", lw=1, label="oracle U*")
    ax.set_yscale("log")
    ax.set_xlabel("ε (δ = 1e-6)")
    ax.set_ylabel("population MSE (median, IQR)")
    ax.set_title(f"n = 20,000, m = 5, d = 50, k = 2, T = 5; {len(rows) // len(eps)} seeds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=130)
