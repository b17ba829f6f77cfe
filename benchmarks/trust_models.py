"""The three trust models side by side: a whole ``fedpers run altmin`` under central, distributed and local
DP, and one SecAgg+ round against a central round, each pair timed interleaved in one process.

    PYTHONPATH=$PWD python -m benchmarks.trust_models                       # 10^5 users, 3 repeats
    PYTHONPATH=$PWD python -m benchmarks.trust_models --users 1000000 --repeats 1
    PYTHONPATH=$PWD python -m benchmarks.trust_models --secagg 100 1000     # SecAgg+ rounds (no runs)

Runs: the default AltMin config at ``--users`` (d = 10, k = 2, m = 16, T = 2, 8 nodes), ``--baselines
none``, in this process (``execute(write=False)``: the run's own work, start-up excluded), the three
models in turn ``--repeats`` times; medians and their ratios to central's median.

``--secagg N ...``: one SecAgg+ round (:func:`fedpers.privacy.secagg.secure_sum`, every node's work in
this process, degree 2⌈log₂ n⌉, D = 1,024, 16 bits) against central's aggregation of the same nodes'
vectors (a float sum), per round. No Flower: the simulation's per-message cost is in neither side.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fedpers import config
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute

MODELS = ("central", "distributed", "local")


def run_times(users: int, repeats: int, algorithm: str = "altmin", **values: object) -> dict[str, list[float]]:
    """Seconds of a whole run (no baselines) under each trust model, interleaved ``repeats`` times."""
    exp = EXPERIMENTS[algorithm]
    cfg = config.build(exp.config_type, {"n_users": users, "baselines": "none", **values})
    small = config.build(exp.config_type, {"n_users": min(users, 2000), "baselines": "none", **values})
    times: dict[str, list[float]] = {m: [] for m in MODELS}
    for model in MODELS:  # warm every path once (imports, calibration caches), untimed
        execute(exp, small, config.build(RuntimeOptions, {"dp_model": model}), write=False, progress=False)
    for _ in range(repeats):
        for model in MODELS:
            opts = config.build(RuntimeOptions, {"dp_model": model})
            t = time.perf_counter()
            execute(exp, cfg, opts, write=False, progress=False)
            times[model].append(time.perf_counter() - t)
    return times


def run_ratios(users: int, repeats: int) -> dict[str, float]:
    """Median seconds per model and distributed/central, local/central (the figures docs/benchmarks.md quotes)."""
    times = run_times(users, repeats)
    med = {m: statistics.median(t) for m, t in times.items()}
    return {**{f"{m}_s": v for m, v in med.items()}, **{f"{m}/central": med[m] / med["central"] for m in MODELS[1:]}}


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
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--secagg", type=int, nargs="*", default=None, help="SecAgg+ rounds at these node counts")
    a = ap.parse_args(argv)
    if a.secagg:
        for n, secure, central in secagg_rounds(a.secagg):
            print(f"SecAgg+ {n:,} nodes: {secure:.3f} s a round, central {central:.2e} s ({secure / central:,.0f}×)")
        return 0
    from fedpers.memory import reuse_freed_memory

    reuse_freed_memory()  # the fedpers command's malloc policy, so runs here cost what a run costs
    r = run_ratios(a.users, a.repeats)
    print(
        f"AltMin {a.users:,} users, medians of {a.repeats}: central {r['central_s']:.2f} s, "
        f"distributed {r['distributed_s']:.2f} s ({r['distributed/central']:.2f}×), "
        f"local {r['local_s']:.2f} s ({r['local/central']:.2f}×)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
