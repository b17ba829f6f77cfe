"""The trust-model figure and table from the sweep set simulations/trust_models.toml (docs/privacy.md,
"Three trust models"): private error of AltMin and FedRep under central, distributed (Skellam under a
modular secure sum, b bits) and local DP, with the non-private reference, side by side.

    fedpers sweep simulations/trust_models.toml --out OUT_DIR     # runs the grid (the one source of it)
    python simulations/trust_models.py OUT_DIR                     # OUT_DIR/table.md, OUT_DIR/trust_models.png

Reads each member sweep's table (OUT_DIR/trust_models_altmin/table.csv, .../trust_models_fedrep/table.csv:
subspace error, modular-wrap and suspected-wrap counts per run, refused runs with their reason) and writes the
median over repetitions per (algorithm, trust model, ε), its ratio to central, the wrap counts, and the
refusals. OUT_DIR/runs.jsonl, written by this script's earlier versions (one line per run), is read too.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def members() -> list[tuple[str, str]]:
    """(algorithm, sweep name) of each member of the sweep set simulations/trust_models.toml."""
    from fedpers.sweeps.sets import sweep_set
    from fedpers.sweeps.spec import load_spec

    found = sweep_set(HERE / "trust_models.toml")
    assert found is not None, "simulations/trust_models.toml must be a sweep set"
    return [(spec.algorithm, spec.name) for spec in (load_spec(f) for f in found[1])]


def _cell(v: str) -> Any:
    if v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return v


def sweep_rows(out: Path) -> list[dict[str, Any]]:
    """Each run of the sweep set's tables under ``out`` as {algorithm, model, epsilon, seed, subspace_error,
    modular_wraps, suspected_wraps} or {algorithm, model, epsilon, seed, refused}."""
    rows = []
    for algorithm, name in members():
        table = out / name / "table.csv"
        if not table.exists():
            continue
        with table.open() as f:
            for raw in csv.DictReader(f):
                r = {k: _cell(v) for k, v in raw.items()}
                eps = r["epsilon"]
                row = {"algorithm": algorithm, "model": str(raw["trust_model"]), "seed": int(r["repetition"])}
                row["epsilon"] = "inf" if eps == float("inf") else eps
                if r.get("refused"):
                    row["refused"] = str(r["refused"])
                else:
                    row.update({k: r.get(k) for k in ("subspace_error", "modular_wraps", "suspected_wraps")})
                rows.append(row)
    log = out / "runs.jsonl"
    if log.exists():
        rows += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the --out of `fedpers sweep simulations/trust_models.toml`")
    a = p.parse_args(argv)
    every = sweep_rows(a.out)
    if not every:
        raise SystemExit(f"{a.out}: no sweep tables (run `fedpers sweep simulations/trust_models.toml --out {a.out}`)")
    summarise(every, a.out)


def summarise(every: list[dict[str, Any]], out: Path) -> None:
    """Median subspace error per (algorithm, model, ε) over seeds: table.md and trust_models.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in every if "refused" not in r]
    refused = sorted({(r["algorithm"], r["model"], r["refused"]) for r in every if "refused" in r})
    cells: dict[tuple[str, str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["algorithm"], r["model"], r["epsilon"]), []).append(r)
    algorithms = sorted({r["algorithm"] for r in rows})
    lines = [
        "| algorithm | trust model | ε | seeds | median subspace error | vs central | modular wraps | suspected wraps |",
        "|---|---|---|---|---|---|---|---|",
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
                runs = cells[(algorithm, m, e)]
                wraps = " | ".join(_total(runs, k) for k in ("modular_wraps", "suspected_wraps"))
                lines.append(f"| {algorithm} | {m} | {e:g} | {len(runs)} | {v:.4f} | {v / ref:.3f} | {wraps} |")
        npriv = cells.get((algorithm, "non-private", "inf"))
        if npriv:
            v = statistics.median(r["subspace_error"] for r in npriv)
            ax.axhline(v, color="k", ls="--", label="non-private")
            lines.append(f"| {algorithm} | non-private | inf | {len(npriv)} | {v:.4f} | | — | — |")
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


def _total(runs: list[dict[str, Any]], key: str) -> str:
    """A wrap count summed over the runs, or — where they have none (no modular sum: central, local)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return str(int(sum(values))) if values else "—"


def _model_order(m: str) -> tuple[int, int]:
    if m == "central":
        return (0, 0)
    if m.startswith("distributed"):
        return (1, int(m.split("=")[1]))
    return (2, 0)


if __name__ == "__main__":
    main()
