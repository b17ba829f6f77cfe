"""Ragged per-user rating data, padded per user: (items, ratings, train mask, test mask).

Synthetic recommender with known truth: item embeddings U* (items × k), user embeddings
v*_j from (seed, id), power-law item popularity p_i ∝ (i+1)^(−a), ragged activity (per-user
counts log-uniform in [min_count, max_count]). Each user's items come in a random order
derived from (seed, id) — public, so "the first B rated items" is a public sampling rule —
and a seeded per-user fraction of them is held out for testing.
"""

from __future__ import annotations

import math

import numpy as np
import torch

Tensor = torch.Tensor


def true_items(seed: int, n_items: int, rank: int) -> Tensor:
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(n_items, rank, generator=g, dtype=torch.float64) / math.sqrt(rank)


def synthetic_users(
    seed: int,
    ids: Tensor,
    n_items: int,
    rank: int,
    min_count: int,
    max_count: int,
    popularity: float,
    noise: float,
    test_fraction: float,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """Users ``ids``, each generated from (seed, id) alone: any chunk gives the same users."""
    U = true_items(seed, n_items, rank).numpy()
    logp = -popularity * np.log(np.arange(1, n_items + 1))
    n = int(ids.shape[0])
    items = np.zeros((n, max_count), dtype=np.int64)
    ratings = np.zeros((n, max_count))
    valid = np.zeros((n, max_count), dtype=bool)
    test = np.zeros((n, max_count), dtype=bool)
    for row, uid in enumerate(ids.tolist()):
        rng = np.random.Generator(np.random.Philox(key=[int(seed), int(uid)]))
        c = round(math.exp(rng.uniform(math.log(min_count), math.log(max_count))))
        c = min(max(c, min_count), max_count, n_items)
        chosen = np.argpartition(-(logp + rng.gumbel(size=n_items)), c - 1)[:c]
        rng.shuffle(chosen)
        v = rng.standard_normal(rank)
        items[row, :c] = chosen
        ratings[row, :c] = U[chosen] @ v + noise * rng.standard_normal(c)
        valid[row, :c] = True
        test[row, :c] = rng.random(c) < test_fraction
    return {
        "ids": ids.clone(),
        "items": torch.from_numpy(items),
        "ratings": torch.from_numpy(ratings).to(dtype),
        "mask": torch.from_numpy(valid & ~test),
        "test": torch.from_numpy(valid & test),
    }
