"""One private ALS step on synthetic data the size of MovieLens-20M (CPU, float32).

138,000 users, 27,000 items, ≈20 M ratings (ragged: per-user counts log-uniform in
[20, 1,000] scaled to the target total, items by power-law popularity), k = 32. Measures the
per-item statistics (users' ridge solves + per-item scatter-add, chunked as the local runtime
does) and the whole step (statistics + two Gaussian releases + PSD repair + per-item solves),
the peak memory, and the ratio to a plain GEMM of the same flop count timed in the same run.

    PYTHONPATH=$PWD python benchmarks/dpals_step.py [--users 138000 --items 27000 --ratings 20000000]
"""
from __future__ import annotations

import argparse
import math
import resource
import time

import torch

from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message
from fedpers.protocols.dpals import DpAlsProtocol, item_statistics


def user_counts(g: torch.Generator, n: int, mean_count: float, width: int) -> torch.Tensor:
    """Ragged counts, sorted so each chunk is padded only to its own widest user (as a loader would bucket)."""
    logc = torch.empty(n).uniform_(math.log(20), math.log(1000), generator=g)
    return (logc.exp() * mean_count / ((1000 - 20) / math.log(1000 / 20))).round().clamp(1, width).long().sort().values


def chunk_data(g: torch.Generator, counts: torch.Tensor, n_items: int):
    n, width = int(counts.shape[0]), int(counts.max())
    popularity = torch.arange(1, n_items + 1, dtype=torch.float64).pow(-0.8)
    items = torch.multinomial(popularity, n * width, replacement=True, generator=g).view(n, width)
    mask = torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)
    ratings = torch.randint(1, 6, (n, width), generator=g).float() * mask
    return items, ratings, mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=138_000)
    ap.add_argument("--items", type=int, default=27_000)
    ap.add_argument("--ratings", type=int, default=20_000_000)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--width", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--items-per-user", type=int, default=100)
    a = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    k = a.rank
    mean_count = a.ratings / a.users
    U = torch.randn(a.items, k) / math.sqrt(k)
    proto = DpAlsProtocol(n_items=a.items, rank=k, steps=1, items_per_user=a.items_per_user, ridge_user=0.1, ridge_item=1.0,
                          gram_bound=math.sqrt(a.items_per_user), rhs_bound=5 * math.sqrt(a.items_per_user),
                          noise_multiplier=5.0, initial_U=U, dtype_name="float32")
    counts = user_counts(g, a.users, mean_count, a.width)
    data = [chunk_data(g, counts[s:s + a.chunk], a.items) for s in range(0, a.users, a.chunk)]
    total = int(sum(int(m.sum()) for _, _, m in data))
    contributed = int(sum(int(torch.clamp(m.sum(1), max=a.items_per_user).sum()) for _, _, m in data))
    start = time.perf_counter()
    G = torch.zeros(a.items, k, k)
    b = torch.zeros(a.items, k)
    for items, ratings, mask in data:
        g_part, b_part = item_statistics(U, items, ratings, mask, 0.1, a.items_per_user, proto.gram_bound, proto.rhs_bound)
        G += g_part
        b += b_part
    t_stats = time.perf_counter() - start
    state, _ = proto.server_update(0, {"U": U}, Message({"G": G, "b": b}, a.users), Privatizer(1))
    t_step = time.perf_counter() - start
    assert torch.isfinite(state["U"]).all()
    # flops of the step: users' Grams (2·L·k² each, padded width as computed) + solves, the scatter, the item solves
    padded = sum(int(m.numel()) for _, _, m in data)
    flops = 2 * padded * k * k + 2 * padded * k + a.users * (2 * k**3 // 3) + a.items * (10 * k**3)
    n = round((flops / 2) ** (1 / 3))
    x, y = torch.randn(n, n), torch.randn(n, n)
    t0 = time.perf_counter()
    x @ y
    t_gemm = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"users={a.users} items={a.items} ratings={total} (padded {padded}) k={k} B={a.items_per_user} "
          f"contributed={contributed} threads={torch.get_num_threads()}")
    print(f"per-item statistics: {t_stats:.2f} s   whole step: {t_step:.2f} s   peak RSS: {peak:.2f} GiB (includes the data set)")
    print(f"GEMM {n}×{n} of equal flops ({flops / 1e9:.1f} GFLOP): {t_gemm:.2f} s   ratio step/GEMM: {t_step / t_gemm:.1f}")


if __name__ == "__main__":
    main()
