"""The accounting gap in one command: the papers' noise calibrations against the accountant's.

Runs ``accounting_showcase.toml`` (AltMin, Theorem 4.2's calibration) and
``accounting_showcase_noisyhead.toml`` (NoisyHead, per-step (ε/T, δ/T)), then writes
``OUT/showcase.md`` (the table: noise multiplier, ε the ledger actually spends, utility) and
``OUT/showcase.png`` (utility vs target ε, paper vs accountant, one panel per algorithm).

    PYTHONPATH=$PWD python simulations/accounting_showcase.py OUT_DIR [--quiet]
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from fedpers import config as config_lib
from fedpers.experiments import experiment
from fedpers.results.plots import grid_ticks
from fedpers.runner import execute
from fedpers.sweeps.run import load_spec, run_sweep

HERE = Path(__file__).resolve().parent
SWEEPS = {
    "altmin": ("accounting_showcase.toml", "subspace_error"),
    "noisyhead": ("accounting_showcase_noisyhead.toml", "excess_risk"),
}


def summary(table: Path, metric: str) -> dict[tuple[float, str], tuple[float, float]]:
    """(ε, calibration) → (mean, standard error) of ``metric`` over repetitions."""
    groups: dict[tuple[float, str], list[float]] = {}
    with open(table) as f:
        for row in csv.DictReader(f):
            groups.setdefault((float(row["epsilon"]), row["calibration"]), []).append(float(row[metric]))
    out = {}
    for key, vals in groups.items():
        mean = sum(vals) / len(vals)
        var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
        out[key] = (mean, math.sqrt(var / len(vals)))
    return out


def privacy(name: str, spec_path: Path, eps: float, calibration: str) -> dict:
    """The noise multiplier and the ε the ledger spends, from one run of the point (seed 0)."""
    spec = load_spec(spec_path)
    exp = experiment(name)
    cfg = config_lib.build(exp.config_type, {**spec.base, "epsilon": eps, "calibration": calibration})
    return execute(exp, cfg, write=False, progress=False)["privacy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "| algorithm | target ε | calibration | noise multiplier | ε spent (PLD) | metric | mean ± s.e. |",
        "|---|---|---|---|---|---|---|",
    ]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, (file, metric)) in zip(axes, SWEEPS.items()):
        run_sweep(HERE / file, out=a.out / name, progress=not a.quiet)
        stats = summary(a.out / name / "table.csv", metric)
        for calibration in ("paper", "accountant"):
            xs = sorted(e for e, c in stats if c == calibration)
            means = [stats[(e, calibration)][0] for e in xs]
            ses = [stats[(e, calibration)][1] for e in xs]
            ax.errorbar(xs, means, yerr=[2 * s for s in ses], marker="o", capsize=3, label=f"{calibration} calibration")
            for e in xs:
                p = privacy(name, HERE / file, e, calibration)
                m, s = stats[(e, calibration)]
                lines.append(
                    f"| {name} | {e:g} | {calibration} | {p['noise_multiplier']:.4g} | {p['epsilon']:.3g} | {metric} | {m:.3g} ± {s:.2g} |"
                )
        grid_ticks(ax, xs, "log")
        ax.set_yscale("log")
        ax.set_xlabel("target ε (δ = 1e-5)")
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_title(f"{name}: the paper's noise vs the accountant's", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out / "showcase.png", dpi=110)
    (a.out / "showcase.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
