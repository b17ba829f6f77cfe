"""One private ALS step on synthetic data the size of MovieLens-20M (float32).

138,000 users, 26,744 items, ≈20 M ratings (ragged: per-user counts log-uniform in
[20, 1,000] scaled to the target total, items by power-law popularity), k = 32, B = 100. Measures
the per-item statistics (what the local runtime runs per chunk: users' ridge solves and the
per-item sums, ``client_message`` of each chunk, summed in place as the runtime sums them) and the
whole step (statistics + two Gaussian releases + PSD repair + per-item solves), the peak memory, and the ratio to a plain GEMM
of the same flop count timed in the same run on the same device.

    PYTHONPATH=$PWD python benchmarks/dpals_step.py [--users 13800 --ratings 2000000]
    PYTHONPATH=$PWD python benchmarks/dpals_step.py --device cuda          # device kernels (GPU)
    PYTHONPATH=$PWD python benchmarks/dpals_step.py --kernels device       # the GPU code path on CPU

The data are generated on the CPU before the clock starts and moved to ``--device``; the noise
is drawn by the Privatizer on the CPU as in a run (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time

import torch

from fedpers.config import device_path
from fedpers.devices import Checks, deferring, to_host
from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message, client_message
from fedpers.protocols.dpals import DpAlsProtocol


def user_counts(g: torch.Generator, n: int, mean_count: float, width: int) -> torch.Tensor:
    """Ragged counts, sorted so each chunk is padded only to its own widest user (as a loader would bucket)."""
    logc = torch.empty(n).uniform_(math.log(20), math.log(1000), generator=g)
    return (logc.exp() * mean_count / ((1000 - 20) / math.log(1000 / 20))).round().clamp(1, width).long().sort().values


def chunk_data(g: torch.Generator, counts: torch.Tensor, n_items: int) -> tuple[torch.Tensor, ...]:
    n, width = int(counts.shape[0]), int(counts.max())
    popularity = torch.arange(1, n_items + 1, dtype=torch.float64).pow(-0.8)
    items = torch.multinomial(popularity, n * width, replacement=True, generator=g).view(n, width)
    mask = torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)
    ratings = torch.randint(1, 6, (n, width), generator=g).float() * mask
    return items, ratings, mask


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=138_000)
    ap.add_argument("--items", type=int, default=26_744)
    ap.add_argument("--ratings", type=int, default=20_000_000)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--width", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=4096, help="users per chunk (the local runtime's chunk_size)")
    ap.add_argument("--items-per-user", type=int, default=100)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--kernels", default="auto", help="auto (device kernels on cuda), device or host")
    ap.add_argument(
        "--malloc",
        default="reuse",
        choices=["reuse", "system"],
        help="reuse: the fedpers command's malloc policy (fedpers.memory.reuse_freed_memory); system: glibc's",
    )
    a = ap.parse_args()
    malloc = "system"
    if a.malloc == "reuse":
        from fedpers.memory import reuse_freed_memory

        malloc = "reuse" if reuse_freed_memory() else "system"
    device = torch.device(a.device)
    kernels = device_path(a.device, a.kernels)
    g = torch.Generator().manual_seed(0)
    k = a.rank
    mean_count = a.ratings / a.users
    U_host = torch.randn(a.items, k, generator=g) / math.sqrt(k)
    U = U_host.to(device)
    root_b = math.sqrt(a.items_per_user)
    proto = DpAlsProtocol(
        n_items=a.items,
        rank=k,
        steps=1,
        items_per_user=a.items_per_user,
        ridge_user=0.1,
        ridge_item=1.0,
        gram_bound=root_b,
        rhs_bound=5 * root_b,
        noise_multiplier=5.0,
        initial_U=U_host,
        dtype_name="float32",
        device_kernels=kernels,
    )
    counts = user_counts(g, a.users, mean_count, a.width)
    chunks = []
    for s in range(0, a.users, a.chunk):
        items, ratings, mask = chunk_data(g, counts[s : s + a.chunk], a.items)
        ids = torch.arange(s, s + int(items.shape[0]))
        chunks.append({"ids": ids, "items": items, "ratings": ratings, "mask": mask})
    total = int(sum(int(c["mask"].sum()) for c in chunks))
    contributed = int(sum(int(c["mask"].sum(1).clamp(max=a.items_per_user).sum()) for c in chunks))
    padded = sum(int(c["mask"].numel()) for c in chunks)
    chunks = [{key: t.to(device) for key, t in c.items()} for c in chunks]
    load = os.getloadavg()
    sync(device)
    cpu0, main0 = _cpu_seconds(), time.thread_time()
    start = time.perf_counter()
    summed = None
    # as the local runtime's round: off the CPU each chunk's checks are deferred into one flag, read once
    # with the summed message (fedpers.devices); on the CPU each message is checked as it is made
    checks = Checks() if device.type != "cpu" else None
    with deferring(checks):
        for units in chunks:
            part = client_message(proto, 0, {"U": U}, units)
            # summed in place, as the local runtime sums a round's chunks (one copy, then Message.add_)
            summed = part.copy() if summed is None else summed.add_(part)
    assert summed is not None
    names = list(summed.stats)
    host = to_host([summed.stats[k] for k in names] + ([checks.flag] if checks and checks.flag is not None else []))
    assert checks is None or checks.flag is None or bool(host[-1]), "a deferred check failed: the round is made again"
    sync(device)
    t_stats = time.perf_counter() - start
    cpu_stats, main_stats = _cpu_seconds() - cpu0, time.thread_time() - main0
    # the server step on the host, as the local runtime makes it
    state, _ = proto.server_update(0, {"U": U_host}, Message(dict(zip(names, host)), a.users), Privatizer(1))
    sync(device)
    t_step = time.perf_counter() - start
    cpu_step, main_step = _cpu_seconds() - cpu0, time.thread_time() - main0
    assert torch.isfinite(state["U"]).all()
    # flops of the step: users' Grams (2·L·k², padded width) and right-hand sides, their solves, the
    # per-item sums (k(k+1)/2 + k per contributed rating), the item solves
    flops = (
        2 * padded * k * k
        + 2 * padded * k
        + a.users * (k**3 // 3)
        + 2 * contributed * (k * (k + 1) // 2 + k)
        + a.items * (10 * k**3)
    )
    n = round((flops / 2) ** (1 / 3))
    x, y = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    x @ y
    sync(device)
    t_gemm = math.inf
    for _ in range(3):  # the fastest of three: one GEMM on a loaded machine varies several-fold
        t0 = time.perf_counter()
        x @ y
        sync(device)
        t_gemm = min(t_gemm, time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"users={a.users} items={a.items} ratings={total} (padded {padded}) k={k} B={a.items_per_user} "
        f"contributed={contributed} chunk={a.chunk} device={device} kernels={'device' if kernels else 'host'} "
        f"threads={torch.get_num_threads()} malloc={malloc} load average at start={load[0]:.1f}"
    )
    print(
        f"per-item statistics: {t_stats:.2f} s   whole step: {t_step:.2f} s   "
        f"peak RSS: {peak:.2f} GiB (includes the data set)"
        + (
            f"   peak device memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
            if device.type == "cuda"
            else ""
        )
    )
    print(
        f"CPU seconds (user + system, all threads; load-independent): statistics {cpu_stats:.2f}, whole step "
        f"{cpu_step:.2f}; on the calling thread (the serial part; the rest ran on worker threads): "
        f"{main_stats:.2f}, {main_step:.2f}"
    )
    print(
        f"GEMM {n}×{n} of equal flops ({flops / 1e9:.1f} GFLOP): {t_gemm:.2f} s   ratio step/GEMM (fastest of 3): {t_step / t_gemm:.1f}"
    )


if __name__ == "__main__":
    main()
