"""Poisson-sampled (amplified) correlated noise against independent Poisson noise and every cyclic strategy,
at equal (ε, δ) and equal expected cohort, for FedRep and NoisyGD (docs/fedrep.md, "Amplified correlated noise").

At each K ∈ {4, 16} every series takes n/K units a round in expectation: cyclic cohorts (K id blocks in
turn) with independent noise, the banded square root (b = K), the optimised banded strategy (b = K) and a
BLT (buffers chosen); Poisson sampling at q = 1/K with independent noise; and amplified banded MF at the
same q with the optimised strategy and its number of groups b chosen for the run's ε (b id blocks taken
in turn, each sampled at q·b; b = 1 is independent Poisson, b = K the cycle). Writes one JSON line per
run to OUT/runs.jsonl (a run already there is skipped, so the grid can be resumed), then OUT/table.md
(mean ± s.e. [median] per point) and OUT/amplified_correlated.png.

    PYTHONPATH=$PWD python simulations/amplified_correlated.py OUT [--seeds 10] [--algorithms fedrep,noisygd]
    PYTHONPATH=$PWD python simulations/amplified_correlated.py OUT --plot-only     # table and figure from OUT/runs.jsonl
    PYTHONPATH=$PWD python simulations/amplified_correlated.py OUT --model         # each b's z and modelled error
    PYTHONPATH=$PWD python simulations/amplified_correlated.py OUT --mmcc-model    # MMCC's z and error per b (add/remove)

The protocol of a configuration (its calibration and strategy) does not depend on the seed: it is built
once per point and reused for the point's seeds (the runs are otherwise the runner's own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

FEDREP = {
    "n_users": 1000, "dim": 10, "rank": 2, "samples_per_user": 5, "refit_samples": 5, "test_samples": 20,
    "noise_std": 0.01, "delta": 1e-6, "rounds": 16, "learning_rate": 2.5, "clip": 0.5, "baselines": "none",
}  # fmt: skip
NOISYGD = {
    "classes": 10, "feature_dim": 20, "examples": 2000, "steps": 32, "collapse": "random", "beta": 0.3,
    "delta": 1e-5, "test_examples": 500, "baselines": "none",
}  # fmt: skip
BASES = {"fedrep": FEDREP, "noisygd": NOISYGD}
METRIC = {"fedrep": "population_mse", "noisygd": "accuracy"}
CYCLES = (4, 16)
EPSILONS = (1.0, 2.0, 4.0, 8.0)


def series(K: int) -> dict[str, dict[str, Any]]:
    """Every mechanism at expected cohort n/K: name → config values."""
    cyclic = {"cohorts": "cyclic", "cycle": K}
    poisson = {"cohorts": "poisson", "sampling_rate": 1.0 / K}
    return {
        "cyclic, independent": cyclic,
        "cyclic, banded sqrt": {**cyclic, "noise": "banded"},
        "cyclic, optimised": {**cyclic, "noise": "optimised"},
        "cyclic, BLT": {**cyclic, "noise": "blt"},
        "Poisson, independent": poisson,
        "Poisson, amplified optimised": {**poisson, "noise": "optimised"},
    }


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["algorithm"], row["K"], row["epsilon"], row["series"], row["seed"])


def run_grid(out: Path, algorithms: list[str], seeds: int, epsilons: tuple[float, ...]) -> None:
    from fedpers import config
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute

    path = out / "runs.jsonl"
    done = {key(r) for r in read_rows(path)}
    for name in algorithms:
        exp = EXPERIMENTS[name]
        protocols: dict[Any, Any] = {}
        build = exp.protocol

        def cached(
            cfg: Any, calibrations: Any = None, build: Any = build, protocols: dict[Any, Any] = protocols
        ) -> Any:
            point = dataclasses.replace(cfg, seed=0)  # the protocol is the same for every seed of a point
            if point not in protocols:
                protocols[point] = build(cfg, calibrations)
            return protocols[point]

        exp.protocol = cached  # type: ignore[method-assign]
        try:
            for K in CYCLES:
                for eps in epsilons:
                    for label, values in series(K).items():
                        for seed in range(seeds):
                            row = {"algorithm": name, "K": K, "epsilon": eps, "series": label, "seed": seed}
                            if key(row) in done:
                                continue
                            cfg = config.build(exp.config_type, {**BASES[name], **values, "epsilon": eps, "seed": seed})
                            start = time.perf_counter()
                            result = execute(exp, cfg, write=False, progress=False)
                            p = result["privacy"]
                            row.update(
                                metric=METRIC[name],
                                value=result[METRIC[name]],
                                epsilon_spent=p["epsilon"],
                                noise_multiplier=p["noise_multiplier"],
                                noise=p.get("noise", "independent"),
                                groups=p.get("groups"),
                                bands=p.get("bands"),
                                buffers=p.get("buffers"),
                                sampling=p.get("sampling"),
                                strategy_note=p.get("strategy_note"),
                                seconds=round(time.perf_counter() - start, 2),
                            )
                            with path.open("a") as f:
                                f.write(json.dumps(row) + "\n")
                            print(json.dumps(row), flush=True)
        finally:
            exp.protocol = build  # type: ignore[method-assign]


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarise(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str, float], tuple[float, float, float, int]]:
    """(algorithm, K, series, ε) → (mean, standard error, median, runs)."""
    groups: dict[tuple[str, int, str, float], list[float]] = {}
    for r in rows:
        groups.setdefault((r["algorithm"], r["K"], r["series"], r["epsilon"]), []).append(float(r["value"]))
    out = {}
    for k, v in groups.items():
        se = statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan
        out[k] = (statistics.fmean(v), se, statistics.median(v), len(v))
    return out


def ratio(note: str | None) -> str:
    """The modelled error ratio a strategy note states ("… 0.7× the error of independent Poisson noise …")."""
    import re

    found = re.search(r"([0-9.]+)× the error", note or "")
    return f"{found.group(1)}×" if found else "?"


def table(rows: list[dict[str, Any]]) -> str:
    stats = summarise(rows)
    eps = sorted({r["epsilon"] for r in rows})
    lines = []
    for name in sorted({r["algorithm"] for r in rows}):
        metric = METRIC[name]
        lines += [
            f"### {name}: {metric} (mean ± s.e. [median]; {'higher' if metric == 'accuracy' else 'lower'} is better)",
            "",
        ]
        lines += ["| K | mechanism | " + " | ".join(f"ε = {e:g}" for e in eps) + " |", "|---|---|" + "---|" * len(eps)]
        for K in CYCLES:
            for label in series(K):
                cells = []
                for e in eps:
                    s = stats.get((name, K, label, e))
                    cells.append("–" if s is None else f"{s[0]:.4g} ± {s[1]:.2g} [{s[2]:.4g}]")
                lines.append(f"| {K} | {label} | " + " | ".join(cells) + " |")
        chosen = sorted(
            {(r["K"], r["epsilon"], r["groups"] or 1, ratio(r["strategy_note"])) for r in rows
             if r["algorithm"] == name and "amplified" in r["series"]}
        )  # fmt: skip
        lines += [
            "",
            "Groups b the amplified strategy chose, and its modelled error against independent Poisson noise "
            "(K, ε: b, ratio): " + ", ".join(f"{k}, {e:g}: {b}, {x}" for k, e, b, x in chosen),
            "",
        ]
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> str:
    """Per (algorithm, K, ε): the amplified series against independent Poisson noise and the best cyclic
    series, as the mean over seeds of the paired (same seed, so the same data) difference ± its standard
    error, signed so that > 0 means the amplified series is better."""
    value = {(r["algorithm"], r["K"], r["epsilon"], r["series"], r["seed"]): float(r["value"]) for r in rows}
    stats = summarise(rows)
    lines = [
        "| algorithm | K | ε | b | amplified − independent Poisson | amplified − best cyclic (which) | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, K, eps in sorted({(r["algorithm"], r["K"], r["epsilon"]) for r in rows}):
        sign = 1.0 if METRIC[name] == "accuracy" else -1.0
        cyclic = [lab for lab in series(K) if lab.startswith("cyclic") and (name, K, lab, eps) in stats]
        if not cyclic or (name, K, "Poisson, amplified optimised", eps) not in stats:
            continue
        best = max(cyclic, key=lambda lab: sign * stats[(name, K, lab, eps)][0])

        def paired(
            other: str, name: str = name, K: int = K, eps: float = eps, sign: float = sign
        ) -> tuple[float, float]:
            d = [
                sign * (value[(name, K, eps, "Poisson, amplified optimised", s)] - value[(name, K, eps, other, s)])
                for s in range(100)
                if (name, K, eps, other, s) in value and (name, K, eps, "Poisson, amplified optimised", s) in value
            ]
            se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
            return statistics.fmean(d), se

        b = {
            r["groups"] or 1
            for r in rows
            if (r["algorithm"], r["K"], r["epsilon"]) == (name, K, eps) and "amplified" in r["series"]
        }
        (dp, sp), (dc, sc) = paired("Poisson, independent"), paired(best)
        tied = dp == 0.0 and sp == 0.0
        both = dp > 2 * sp and dc > 2 * sc
        word = "ties independent Poisson (b = 1 chosen)" if tied else ("beats both" if both else "not resolved / loses")
        lines.append(
            f"| {name} | {K} | {eps:g} | {'/'.join(map(str, sorted(b)))} | {dp:+.4g} ± {sp:.2g} | {dc:+.4g} ± {sc:.2g} "
            f"({best}) | {word} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, seeds: int) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = summarise(rows)
    algorithms = sorted({r["algorithm"] for r in rows})
    fig, axes = plt.subplots(len(algorithms), len(CYCLES), figsize=(10, 3.6 * len(algorithms)), squeeze=False)
    styles = {"cyclic": "--", "Poisson": "-"}
    for i, name in enumerate(algorithms):
        for j, K in enumerate(CYCLES):
            ax = axes[i][j]
            for label in series(K):
                pts = sorted((e, s) for (a, k, lab, e), s in stats.items() if a == name and k == K and lab == label)
                if not pts:
                    continue
                x = [e for e, _ in pts]
                ax.errorbar(
                    x, [s[0] for _, s in pts], yerr=[2 * s[1] for _, s in pts], marker="o", capsize=3,
                    linestyle=styles[label.split(",")[0]], label=label, linewidth=2.2 if "amplified" in label else 1.2,
                )  # fmt: skip
            ax.set_xscale("log")
            ax.set_xticks(EPSILONS, [f"{e:g}" for e in EPSILONS])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            if METRIC[name] == "population_mse":
                ax.set_yscale("log")
            ax.set_xlabel("ε")
            ax.set_ylabel(METRIC[name])
            ax.set_title(f"{name}, K = {K} (expected cohort n/K)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle(
        f"amplified correlated noise vs independent Poisson vs cyclic; mean ± 2 s.e. of {seeds} seeds", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def model(algorithms: list[str], epsilons: tuple[float, ...]) -> str:
    """For each point, every number of groups b the amplified strategy could take: the noise multiplier
    the run's (ε, δ) needs with b groups and the modelled error (σ² times the A_λ error) against
    independent Poisson noise (b = 1), as the run's own chooser computes them (``--bands b``)."""
    from fedpers import config
    from fedpers.experiments import EXPERIMENTS
    from fedpers.privacy import correlated

    lines = ["| algorithm | K | ε | b: z, modelled error ÷ independent Poisson's |", "|---|---|---|---|"]
    for name in algorithms:
        exp = EXPERIMENTS[name]
        horizon = BASES[name].get("rounds", BASES[name].get("steps"))
        for K in CYCLES:
            for eps in epsilons:
                cells = []
                for b in correlated.sampled_groups(1.0 / K, int(horizon)):
                    values = {**BASES[name], **series(K)["Poisson, amplified optimised"], "bands": b, "epsilon": eps}
                    protocol = exp.protocol(config.build(exp.config_type, values))
                    assert protocol.correlated is not None
                    z = protocol.noise_multiplier
                    cells.append(f"{b}: {z:.3g}, {ratio(protocol.correlated.note)}")
                lines.append(f"| {name} | {K} | {eps:g} | " + "; ".join(cells) + " |")
    return "\n".join(lines)


MMCC_BANDS = (2, 4, 8)
MMCC_GRID = 1e-3
"""The PLD grid the MMCC model solves on (its ε then checked at that grid only: a model, not a run)."""


def mmcc_multiplier(
    coefficients: tuple[float, ...], horizon: int, q: float, epsilon: float, delta: float, start: float
) -> float:
    """The smallest noise multiplier (to 1 %) at which MMCC's ε for the banded stream meets (ε, δ), add/remove,
    bracketed from ``start`` (independent Poisson noise's z: small z, where MMCC's PLDs are widest, is skipped)."""
    from fedpers.privacy import mmcc
    from fedpers.privacy.accountant import event_epsilon

    def eps(z: float) -> float:
        stream = mmcc.MatrixMechanismDpEvent(coefficients, horizon, q, z)
        return event_epsilon(stream, delta, "mmcc", pld_discretisation=MMCC_GRID, neighbours="add-remove")

    lo, hi = start, start * 1.25
    while eps(hi) > epsilon:
        lo, hi = hi, 1.5 * hi
    while lo > 0.05 and eps(lo) <= epsilon:
        lo, hi = lo / 1.5, lo
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > epsilon else (lo, mid)
    return hi


def mmcc_model(algorithms: list[str], epsilons: tuple[float, ...]) -> str:
    """Per (algorithm, K, ε), add/remove neighbours, Poisson sampling at q = 1/K every round: independent
    noise's z (PLD, exact), and for the banded square root and the strategy optimised for one participation
    at b ∈ :data:`MMCC_BANDS` the z MMCC needs and the modelled error of the gradient stream (σ² times the
    A error, σ = z per unit clip) against independent noise's; beside it, the 2023 analysis's best b and
    ratio (block-cyclic, b groups at q·b) as the run's chooser finds it under add/remove."""
    import dp_accounting
    import torch

    from fedpers import config
    from fedpers.experiments import EXPERIMENTS
    from fedpers.privacy import correlated
    from fedpers.privacy.accountant import calibrate_noise_multiplier

    lines = [
        "| algorithm | K | ε | independent Poisson z | MMCC, b: z (sqrt) ratio / z (optimised) ratio | best MMCC ratio | "
        "2023 analysis: b, ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in algorithms:
        exp = EXPERIMENTS[name]
        horizon = int(BASES[name].get("rounds", BASES[name].get("steps")))
        delta = float(BASES[name]["delta"])
        plain = float(correlated.prefix_error(torch.ones(1, dtype=torch.float64), horizon))
        for K in CYCLES:
            q = 1.0 / K
            for eps in epsilons:
                z1 = calibrate_noise_multiplier(
                    lambda z, q=q, horizon=horizon: dp_accounting.SelfComposedDpEvent(
                        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), horizon
                    ),
                    eps,
                    delta,
                    "pld",
                    neighbours="add-remove",
                )
                cells, best = [], math.inf
                for b in MMCC_BANDS:
                    row = []
                    for coefficients in (
                        correlated.sqrt_coefficients(b),
                        correlated.optimised_coefficients(
                            horizon, b, b, patterns=correlated.single_participation(horizon)
                        ),
                    ):
                        c = tuple(float(v) for v in coefficients)
                        zb = mmcc_multiplier(c, horizon, q, eps, delta, z1)
                        err = float(correlated.prefix_error(torch.tensor(c, dtype=torch.float64), horizon))
                        r = zb**2 * err / (z1**2 * plain)
                        best = min(best, r)
                        row.append(f"{zb:.3g} {r:.3g}×")
                    cells.append(f"{b}: " + " / ".join(row))
                values = {**BASES[name], **series(K)["Poisson, amplified optimised"], "epsilon": eps}
                protocol = exp.protocol(config.build(exp.config_type, {**values, "neighbours": "add-remove"}))
                assert protocol.correlated is not None
                chosen = protocol.correlated.cycle if protocol.correlated.strategy.kind != "independent" else 1
                lines.append(
                    f"| {name} | {K} | {eps:g} | {z1:.3g} | " + "; ".join(cells) + f" | {best:.3g}× | "
                    f"{chosen}, {ratio(protocol.correlated.note)} |"
                )
                print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--algorithms", default="fedrep,noisygd")
    parser.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS))
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--model", action="store_true", help="print each candidate b's z and modelled error, then stop")
    parser.add_argument(
        "--mmcc-model",
        action="store_true",
        help="MMCC's z and modelled error per b beside the 2023 analysis's, then stop",
    )
    args = parser.parse_args()
    if args.mmcc_model:
        print(mmcc_model(args.algorithms.split(","), tuple(float(e) for e in args.epsilons.split(","))))
        return
    if args.model:
        print(model(args.algorithms.split(","), tuple(float(e) for e in args.epsilons.split(","))))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        eps = tuple(float(e) for e in args.epsilons.split(","))
        run_grid(args.out, args.algorithms.split(","), args.seeds, eps)
    rows = read_rows(args.out / "runs.jsonl")
    (args.out / "table.md").write_text(table(rows) + "\n\n" + verdict(rows) + "\n")
    plot(rows, args.out / "amplified_correlated.png", max(r["seed"] for r in rows) + 1)
    print(table(rows))
    print(verdict(rows))


if __name__ == "__main__":
    main()
