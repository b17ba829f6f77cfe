"""A whole `fedpers run altmin` against its floor: a GEMM of its flops plus a draw of its normals.

Runs the whole run (init, T rounds, evaluation; no baselines) at n and n/4 users and, in the
same process and interleaved with the runs, a plain GEMM of the run's flop count and a plain
``torch.randn`` of the run's count of normal variates in the working dtype. Prints the run
time over (GEMM + draw) time, the same ratio for the marginal cost of users (n minus n/4: no
start-up or calibration), users per second, and the passes over the users the run generated.

    PYTHONPATH=$PWD python benchmarks/altmin_run.py [--users 200000 --dim 100 --rank 5 --samples 40 --rounds 2 --dtype float32 --device cpu]
    PYTHONPATH=$PWD python benchmarks/altmin_run.py --users 1000000 --device cuda   # GPU: device kernels, floor on the GPU

Flops counted (per user, GEMM-shaped work only): init 2·(m/4)·d² (the pair statistic);
each round, per cohort user, 2·q·d² (X_jᵀX_j) + k(k+1)·d² (the Kronecker GEMM) + 2·q·d·k
(x U); evaluation 2·(m/2)·d·k. Normals: every user's m/2 samples of x and y noise for the
init and again for the evaluation, the cohort's other m/2 per round, and v* once (1.5 passes
at any T; a float64 host run draws more: its users' Mersenne-Twister blocks are drawn whole).
Uses only public APIs, so it runs on an older tree too (PYTHONPATH=that tree).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute


def run_flops(n: int, m: int, d: int, k: int, rounds: int, cohort_fraction: float) -> float:
    q = m // 4
    init = n * 2 * q * d * d
    per_round = n * cohort_fraction * (2 * q * d * d + k * (k + 1) * d * d + 2 * q * d * k)
    evaluation = n * 2 * (m // 2) * d * k
    return init + rounds * per_round + evaluation


def run_normals(n: int, m: int, d: int, k: int, rounds: int, cohort_fraction: float) -> int:
    half = (m // 2) * (d + 1)
    return int(n * (2 * half + k) + rounds * n * cohort_fraction * half)


def gemm_time(flops: float, dtype: torch.dtype, device: str) -> float:
    """Seconds for square GEMMs (side 2048, the last one shortened) totalling ``flops``."""
    side = 2048
    a = torch.randn(side, side, dtype=dtype, device=device)
    b = torch.randn(side, side, dtype=dtype, device=device)
    per = 2.0 * side**3
    full, rest = int(flops // per), flops % per
    tail = a[: max(1, int(rest / (2 * side * side)))]
    a @ b
    _sync(device)
    t = time.perf_counter()
    for _ in range(full):
        a @ b
    tail @ b
    _sync(device)
    return time.perf_counter() - t


def draw_time(count: int, dtype: torch.dtype, device: str) -> float:
    """Seconds for ``torch.randn`` of ``count`` values, 16 M at a time (bounded memory)."""
    step = 1 << 24
    out = torch.empty(step, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    _sync(device)
    t = time.perf_counter()
    for start in range(0, count, step):
        torch.randn(
            min(step, count - start), generator=g, dtype=dtype, device=device, out=out[: min(step, count - start)]
        )
    _sync(device)
    return time.perf_counter() - t


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def whole_run(n: int, args: argparse.Namespace) -> tuple[float, float | None]:
    """(seconds, passes over the users generated, when the tree counts them)."""
    exp = EXPERIMENTS["altmin"]
    values = dict(
        n_users=n,
        dim=args.dim,
        rank=args.rank,
        samples_per_user=args.samples,
        rounds=args.rounds,
        baselines="none",
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
    )
    if "kernels" in exp.config_type.__dataclass_fields__:  # older trees have no device path
        values["kernels"] = args.kernels
    if "cohort_block" in exp.config_type.__dataclass_fields__:  # n and n/4 cohort alike (auto switches at 65,536)
        values["cohort_block"] = 1024
    cfg = config.build(exp.config_type, values)
    from fedpers.data import synthetic

    reset = getattr(synthetic, "reset_counts", None)
    if reset:
        reset()
    _sync(args.device)
    t = time.perf_counter()
    execute(exp, cfg, write=False, progress=False)
    _sync(args.device)
    seconds = time.perf_counter() - t
    return seconds, (synthetic.passes(n) if reset else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--rank", type=int, default=5)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--device", default="cpu", help="cpu or cuda: the run, the GEMM and the draw all run there")
    p.add_argument(
        "--kernels", default="auto", choices=["auto", "device", "host"], help="code path (auto: device on cuda)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="interleaved repetitions (the minimum of each is kept)")
    p.add_argument(
        "--malloc",
        default="reuse",
        choices=["reuse", "system"],
        help="reuse: the fedpers command's malloc policy (fedpers.memory.reuse_freed_memory); system: glibc's",
    )
    args = p.parse_args()
    try:
        from fedpers.memory import reuse_freed_memory
    except ImportError:  # an older tree: glibc's policy, as its fedpers command had
        reuse_freed_memory = None
    malloc = "system"
    if args.malloc == "reuse" and reuse_freed_memory is not None and reuse_freed_memory():
        malloc = "reuse"
    dtype = getattr(torch, args.dtype)
    shape = (
        args.samples,
        args.dim,
        args.rank,
        args.rounds,
        1.0 / args.rounds,
    )  # disjoint cohorts: a 1/T share each round
    best: dict[str, float] = {}
    passes: dict[int, float | None] = {}
    sizes = (args.users, args.users // 4)
    for _ in range(args.repeats):
        for n in sizes:
            for name, fn in (
                (f"run{n}", lambda n=n: whole_run(n, args)),
                (f"gemm{n}", lambda n=n: gemm_time(run_flops(n, *shape), dtype, args.device)),
                (f"draw{n}", lambda n=n: draw_time(run_normals(n, *shape), dtype, args.device)),
            ):
                out = fn()
                if isinstance(out, tuple):
                    out, passes[n] = out
                best[name] = min(best.get(name, float("inf")), out)
    n, small = sizes
    floor = {s: best[f"gemm{s}"] + best[f"draw{s}"] for s in sizes}
    report = {
        "users": n,
        "dim": args.dim,
        "rank": args.rank,
        "samples": args.samples,
        "rounds": args.rounds,
        "dtype": args.dtype,
        "device": args.device,
        "kernels": args.kernels,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(),
        "run_s": round(best[f"run{n}"], 2),
        "gemm_s": round(best[f"gemm{n}"], 2),
        "draw_s": round(best[f"draw{n}"], 2),
        "ratio": round(best[f"run{n}"] / floor[n], 2),
        "marginal_ratio": round((best[f"run{n}"] - best[f"run{small}"]) / (floor[n] - floor[small]), 2),
        "users_per_s": round(n / best[f"run{n}"]),
        "gflops": round(run_flops(n, *shape) / 1e9, 1),
        "normals_M": round(run_normals(n, *shape) / 1e6),
        "passes": passes.get(n),
        "malloc": malloc,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
