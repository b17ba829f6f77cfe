"""The three trust models side by side: a whole ``fedpers run ALGORITHM`` under central, distributed and local
DP, and one SecAgg+ round against a central round, each pair timed interleaved in one process.

    PYTHONPATH=$PWD python -m benchmarks.trust_models                       # AltMin, 10^5 users, 3 repeats
    PYTHONPATH=$PWD python -m benchmarks.trust_models --users 1000000 --repeats 1
    PYTHONPATH=$PWD python -m benchmarks.trust_models --algorithm dpals --users 20000 --floor
    PYTHONPATH=$PWD python -m benchmarks.trust_models --secagg 100 1000     # SecAgg+ rounds (no runs)

Runs: the algorithm's default config at ``--users`` units (AltMin: d = 10, k = 2, m = 16, T = 2; DPALS: 100 items,
k = 4, T = 5 and round 0; NoisyGD: ``--examples``; NoisyHead: ``--prompts``, ``--mode rounds``), 8 nodes,
``--baselines none`` where the algorithm has baselines, in this process (``execute(write=False)``: the run's
own work, start-up excluded), the three models in turn ``--repeats`` times; medians and their ratios to
central's median.

``--floor``: beside each repeat, the nodes' encoding alone for a run of that size (:func:`encoding_floor`: every
unit's vectors of every round rotated and conditionally rounded, or given their Gaussian, from its key, in the
nodes' chunks and shares, on rows already made): the per-unit work no batching of the statistics removes.

``--secagg N ...``: one SecAgg+ round (:func:`fedpers.privacy.secagg.secure_sum`, every node's work in
this process, degree 2⌈log₂ n⌉, D = 1,024, 16 bits) against central's aggregation of the same nodes'
vectors (a float sum), per round. No Flower: the simulation's per-message cost is in neither side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from fedpers import config
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute, resolve

MODELS = ("central", "distributed", "local")
SIZES: dict[str, tuple[str, dict[str, object]]] = {
    "altmin": ("n_users", {"baselines": "none"}),
    "fedrep": ("n_users", {"baselines": "none"}),
    "dpals": ("n_users", {"baselines": "none"}),
    "noisygd": ("examples", {"baselines": "none"}),
    "noisyhead": ("prompts", {"mode": "rounds"}),
}
"""Per algorithm: the config key ``--users`` sets (its privacy units) and the values every run takes (NoisyHead
runs node-side only in its rounds mode)."""


def run_times(
    users: int, repeats: int, algorithm: str = "altmin", floor: bool = False, **values: object
) -> dict[str, list[float]]:
    """Seconds of a whole run (no baselines) under each trust model, interleaved ``repeats`` times; with
    ``floor``, also ``floor_distributed`` and ``floor_local`` (:func:`encoding_floor`) in the same turns."""
    exp = EXPERIMENTS[algorithm]
    key, fixed = SIZES[algorithm]
    cfg = config.build(exp.config_type, {key: users, **fixed, **values})
    small = config.build(exp.config_type, {key: min(users, 2000), **fixed, **values})
    times: dict[str, list[float]] = {m: [] for m in MODELS}
    floors = MODELS[1:] if floor else ()
    times.update({f"floor_{m}": [] for m in floors})
    for model in MODELS:  # warm every path once (imports, calibration caches), untimed
        execute(exp, small, config.build(RuntimeOptions, {"dp_model": model}), write=False, progress=False)
    for model in floors:
        encoding_floor(algorithm, small, model)
    for _ in range(repeats):
        for model in MODELS:
            opts = config.build(RuntimeOptions, {"dp_model": model})
            t = time.perf_counter()
            execute(exp, cfg, opts, write=False, progress=False)
            times[model].append(time.perf_counter() - t)
        for model in floors:
            times[f"floor_{model}"].append(encoding_floor(algorithm, cfg, model))
    return times


def encoding_floor(algorithm: str, cfg: Any, model: str) -> float:
    """Seconds the nodes spend encoding a run of ``cfg``'s size alone: for every round, every unit's vectors
    (rows of the statistics' flattened length, made beforehand) rotated and conditionally rounded
    (distributed) or given their Gaussian (local) from the unit's own key (:func:`~fedpers.runtime.distributed.
    encode_rows`), in the nodes' chunks (:func:`~fedpers.runtime.distributed.node_chunk`) and thread shares —
    what a node does per unit after its statistics, whatever computes them."""
    import torch

    from fedpers.privacy import distributed as dist
    from fedpers.runtime.distributed import encode_rows, in_shares, node_chunk

    exp = EXPERIMENTS[algorithm]
    plan = resolve(exp, cfg, config.build(RuntimeOptions, {"dp_model": model}))
    privatizer, protocol = plan.privatizer, plan.protocol
    n = exp.num_units(cfg)
    generator = torch.Generator().manual_seed(0)
    total = 0.0
    for round in range(protocol.num_rounds):
        specs = protocol.stat_specs(round)
        chunk = node_chunk(cfg.chunk_size, specs, privatizer.plan)
        rows = {  # made once, of norm about half the bound (their values do not change the work)
            s.name: torch.randn(
                chunk, dist.flat_dim(s.shape, s.symmetric), dtype=torch.float64, generator=generator
            ).mul_(s.per_unit_bound / 2 / dist.flat_dim(s.shape, s.symmetric) ** 0.5)
            for s in specs
        }

        def encode(part: dict[str, Any], round: int = round, specs: Any = specs, rows: Any = rows) -> dict[str, Any]:
            m = int(part["ids"].shape[0])
            return encode_rows({k: v[:m] for k, v in rows.items()}, part["ids"], specs, privatizer, round)

        t = time.perf_counter()
        for start in range(0, n, chunk):
            ids = torch.arange(start, min(n, start + chunk))
            in_shares(encode, {"ids": ids})
        total += time.perf_counter() - t
    return total


def run_ratios(users: int, repeats: int, algorithm: str = "altmin", floor: bool = False) -> dict[str, float]:
    """Median seconds per model (and per floor) and each over central's median (the figures the docs quote)."""
    times = run_times(users, repeats, algorithm, floor)
    med = {m: statistics.median(t) for m, t in times.items()}
    return {**{f"{m}_s": v for m, v in med.items()}, **{f"{m}/central": v / med["central"] for m, v in med.items()}}


def secagg_rounds(nodes: list[int], dim: int = 1024, bits: int = 16) -> list[tuple[int, float, float]]:
    """(n, seconds of one SecAgg+ round, seconds of central's float sum) per node count, in this process."""
    import math

    import numpy as np
    import torch

    from fedpers.privacy.secagg import default_threshold, secure_sum

    rng = np.random.default_rng(0)
    out = []
    for n in nodes:
        ints = {i: rng.integers(0, 2**bits, dim) for i in range(n)}
        floats = torch.randn(n, dim, dtype=torch.float64)
        t = time.perf_counter()
        floats.sum(0)
        central = time.perf_counter() - t
        degree = min(n - 1, 2 * math.ceil(math.log2(n)))
        t = time.perf_counter()
        got = secure_sum(ints, bits, degree=degree, threshold=default_threshold(degree))
        secure = time.perf_counter() - t
        assert np.array_equal(got, np.remainder(sum(ints.values()), 2**bits))
        out.append((n, secure, central))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trust_models", description=__doc__)
    ap.add_argument("--algorithm", choices=tuple(SIZES), default="altmin")
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--floor", action="store_true", help="also time the nodes' encoding alone (encoding_floor)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--secagg", type=int, nargs="*", default=None, help="SecAgg+ rounds at these node counts")
    a = ap.parse_args(argv)
    if a.secagg:
        for n, secure, central in secagg_rounds(a.secagg):
            print(f"SecAgg+ {n:,} nodes: {secure:.3f} s a round, central {central:.2e} s ({secure / central:,.0f}×)")
        return 0
    from fedpers.memory import reuse_freed_memory

    reuse_freed_memory()  # the fedpers command's malloc policy, so runs here cost what a run costs
    r = run_ratios(a.users, a.repeats, a.algorithm, a.floor)
    print(
        f"{a.algorithm} {a.users:,} users, medians of {a.repeats}: central {r['central_s']:.2f} s, "
        f"distributed {r['distributed_s']:.2f} s ({r['distributed/central']:.2f}×), "
        f"local {r['local_s']:.2f} s ({r['local/central']:.2f}×)"
    )
    if a.floor:
        print(
            f"  the nodes' encoding alone: distributed {r['floor_distributed_s']:.2f} s "
            f"({r['floor_distributed/central']:.2f}× central's whole run), local {r['floor_local_s']:.2f} s "
            f"({r['floor_local/central']:.2f}×)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
