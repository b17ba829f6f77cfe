"""Bits of the modular sum as a function of n (docs/privacy.md, "Bits as a function of n, d, ε"): AltMin under
distributed DP with the bits chosen automatically (``--bits 0``) and at fixed 12, 16 and 20 bits, against
central, at each n, the median subspace error over seeds and its ratio to central's.

    PYTHONPATH=$PWD python simulations/bits_vs_n.py run [--users 1000 10000 100000] [--seeds 3]
    PYTHONPATH=$PWD python simulations/bits_vs_n.py draw     # docs/figures/bits_vs_n.png and the table
    PYTHONPATH=$PWD python simulations/bits_vs_n.py headroom [--users 100000]  # round sums against n·B

``run`` appends one JSON line per run to docs/data/bits_vs_n_runs.jsonl as it finishes (a refused run records its
reason: too few bits for n is refused before any release) and skips every (n, seed, variant) already there, so
an interrupted run resumes; at each n it runs central and the automatic choice for every seed before the fixed
bits. ``draw`` reads that file only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "bits_vs_n_runs.jsonl"
FIGURE = ROOT / "docs" / "figures" / "bits_vs_n.png"
BASE: dict[str, Any] = {"dim": 10, "rank": 2, "samples_per_user": 16, "rounds": 2, "epsilon": 2.0, "baselines": "none"}
VARIANTS: dict[str, dict[str, Any]] = {
    "central": {"dp_model": "central"},
    "auto": {"dp_model": "distributed", "nodes": 8, "bits": 0},
    "12 bits": {"dp_model": "distributed", "nodes": 8, "bits": 12},
    "16 bits": {"dp_model": "distributed", "nodes": 8, "bits": 16},
    "20 bits": {"dp_model": "distributed", "nodes": 8, "bits": 20},
}


def run(users: list[int], seeds: int) -> None:
    from fedpers import config
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute

    exp = EXPERIMENTS["altmin"]
    DATA.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["n_users"], r["seed"], r["variant"]) for r in _rows()}
    for n in users:
        for name, options in VARIANTS.items():
            for seed in range(seeds):
                if (n, seed, name) in done:
                    continue
                cfg = config.build(exp.config_type, {**BASE, "n_users": n, "seed": seed})
                row: dict[str, Any] = {"n_users": n, "seed": seed, "variant": name, **BASE}
                try:
                    r = execute(exp, cfg, config.build(RuntimeOptions, options), write=False, progress=False)
                except ValueError as e:  # refused before any release (too few bits for n)
                    row["refused"] = str(e)
                else:
                    priv = r["privacy"]
                    row.update(
                        subspace_error=r["subspace_error"],
                        epsilon_spent=r["epsilon"],
                        bits=priv.get("bits"),
                        modular_wraps=r.get("modular_wraps", 0),
                        seconds=r.get("seconds"),
                    )
                with DATA.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def headroom(n: int, seed: int = 0) -> None:
    """How far below the wrap bound's n·B a round's sums lie: ‖Σ_j x_j‖/(n·B) for AltMin round 1's A and b
    (the figure's setting, U a fixed random orthonormal d × k), and the mean ‖x_j‖/B. A scale sized from a
    previous round's released norm could take log₂ of the inverse in bits (not done: docs/privacy.md)."""
    import torch

    from fedpers import config
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import resolve

    exp = EXPERIMENTS["altmin"]
    cfg = config.build(exp.config_type, {**BASE, "n_users": n, "seed": seed})
    p = resolve(exp, cfg, config.build(RuntimeOptions, VARIANTS["auto"]))
    generator = torch.Generator().manual_seed(0)
    d, k = int(BASE["dim"]), int(BASE["rank"])
    U = torch.linalg.qr(torch.randn(d, k, dtype=torch.float64, generator=generator))[0]
    sums: dict[str, Any] = {}
    norms: dict[str, float] = {}
    taking = 0
    for start in range(0, n, 20_000):
        units = p.experiment.units(p.cfg, torch.arange(start, min(n, start + 20_000)))
        got = p.protocol.unit_statistics(1, {"U": U}, units)
        assert got is not None
        for name, rows in got.stats.items():
            sums[name] = sums.get(name, 0) + rows.sum(0)
            norms[name] = norms.get(name, 0.0) + float(torch.linalg.vector_norm(rows.flatten(1), dim=1).sum())
        taking += int(got.ids.numel())
    for spec in p.protocol.stat_specs(1):
        bound = float(spec.per_unit_bound)
        total = float(torch.linalg.vector_norm(sums[spec.name]))
        print(
            f"{spec.name}: {taking} of {n} units in round 1; ‖Σ‖/(n·B) = {total / (n * bound):.4f}, "
            f"‖Σ‖/(units·B) = {total / (taking * bound):.4f}, mean ‖x_j‖/B = {norms[spec.name] / (taking * bound):.4f}"
        )


def _rows() -> list[dict[str, Any]]:
    if not DATA.exists():
        return []
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def table(rows: list[dict[str, Any]]) -> tuple[list[int], dict[str, dict[int, Any]], dict[int, list[int]]]:
    """(users, median error per variant and n or the refusal, the auto choice's bits per n)."""
    users = sorted({r["n_users"] for r in rows})
    med: dict[str, dict[int, Any]] = {v: {} for v in VARIANTS}
    auto_bits: dict[int, list[int]] = {}
    for v in VARIANTS:
        for n in users:
            group = [r for r in rows if r["variant"] == v and r["n_users"] == n]
            done = [r["subspace_error"] for r in group if "subspace_error" in r]
            if done:
                med[v][n] = (statistics.median(done), len(done))
            elif group:
                med[v][n] = "refused"
            if v == "auto":
                auto_bits[n] = sorted({r["bits"] for r in group if r.get("bits") is not None})
    return users, med, auto_bits


def draw() -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows()
    users, med, auto_bits = table(rows)
    lines = [
        "| n | auto bits | "
        + " | ".join(f"{v} error (×central)" for v in VARIANTS if v != "central")
        + " | central error |",
        "|---|---|" + "---|" * (len(VARIANTS) - 1) + "---|",
    ]
    for n in users:
        central = med["central"].get(n)
        cells = []
        for v in VARIANTS:
            if v == "central":
                continue
            got = med[v].get(n)
            if got == "refused":
                cells.append("refused")
            elif got is None or not isinstance(central, tuple):
                cells.append("-")
            else:
                cells.append(f"{got[0]:.4g} ({got[0] / central[0]:.3f}×, {got[1]} seeds)")
        c = f"{central[0]:.4g} ({central[1]} seeds)" if isinstance(central, tuple) else "-"
        lines.append(
            f"| {n:,} | {'/'.join(map(str, auto_bits.get(n, []))) or '-'} | " + " | ".join(cells) + f" | {c} |"
        )
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(users, [max(auto_bits.get(n, [0]) or [0]) for n in users], "o-")
    a.set_xscale("log")
    a.set_xlabel("users n")
    a.set_ylabel("bits chosen (--bits 0)")
    a.set_title("automatic bits vs n (d = 10, k = 2, ε = 2)")
    for v in VARIANTS:
        xs = [n for n in users if isinstance(med[v].get(n), tuple) and isinstance(med["central"].get(n), tuple)]
        ys = [med[v][n][0] / med["central"][n][0] for n in xs]
        if xs and v != "central":
            b.plot(xs, ys, "o-", label=v)
    b.axhline(1.1, color="grey", ls="--", lw=0.8, label="1.1 × central")
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("users n")
    b.set_ylabel("median subspace error / central's")
    b.set_title("distributed error against central")
    b.legend(fontsize=8)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--users", type=int, nargs="+", default=[1000, 10000, 100000])
    r.add_argument("--seeds", type=int, default=3)
    sub.add_parser("draw")
    h = sub.add_parser("headroom")
    h.add_argument("--users", type=int, default=100_000)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.users, a.seeds)
    elif a.cmd == "headroom":
        headroom(a.users)
    else:
        print(draw())


if __name__ == "__main__":
    main()
