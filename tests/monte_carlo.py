"""A Monte Carlo lower estimate of a correlated stream's true ε(δ), shared by tests/test_amplified.py
(block-cyclic sampling) and tests/test_mmcc.py (Poisson sampling every round: ``groups`` = 1)."""

from __future__ import annotations

import itertools
import math

import torch
from scipy import stats


def mc_epsilon_lower(
    C: torch.Tensor,
    sigma: float,
    clip: float,
    q: float,
    groups: int,
    delta: float,
    neighbours: str,
    samples: int = 200_000,
    confidence: float = 0.999,
    seed: int = 0,
) -> float:
    """A lower confidence bound on the true ε(δ) of releasing Cx + σz over T rounds, for the worst unit of
    group 0 (aligned contributions at the clip in every round it is sampled in, each sampled with q) against
    its neighbour (absent, or the opposite contribution under replace-one). The 2^P-component mixture is
    evaluated in the full T dimensions (no use of the banded structure); both directions of the hockey stick,
    δ̂(ε) = E_P[(1 − e^(ε − L))₊] with L = log p/q, minus its standard error times the quantile."""
    g = torch.Generator().manual_seed(seed)
    T = C.shape[0]
    rounds = list(range(0, T, groups))
    P = len(rounds)
    cols = C[:, rounds].double() * clip  # (T, P)
    subsets = torch.tensor(list(itertools.product((0.0, 1.0), repeat=P)), dtype=torch.float64)  # (2^P, P)
    means = subsets @ cols.T  # (2^P, T)
    logw = subsets.sum(1) * math.log(q) + (P - subsets.sum(1)) * math.log1p(-q)

    def log_density(y: torch.Tensor, sign: float | None) -> torch.Tensor:
        if sign is None:  # absent: N(0, σ²I), up to the constant shared by every density here
            return -(y**2).sum(1) / (2 * sigma**2)
        d = y[:, None, :] - sign * means[None]
        return torch.logsumexp(logw[None] - (d**2).sum(2) / (2 * sigma**2), dim=1)

    def draw(sign: float | None, n: int) -> torch.Tensor:
        y = sigma * torch.randn(n, T, generator=g, dtype=torch.float64)
        if sign is None:
            return y
        pick = (torch.rand(n, P, generator=g, dtype=torch.float64) < q).double()
        return y + sign * pick @ cols.T

    pairs = [(1.0, None), (None, 1.0)] if neighbours == "add-remove" else [(1.0, -1.0)]
    zq = stats.norm.ppf(confidence)
    best = 0.0
    for first, second in pairs:
        losses = []
        for _ in range(samples // 20_000):
            y = draw(first, 20_000)
            losses.append(log_density(y, first) - log_density(y, second))
        L = torch.cat(losses)

        def delta_lower(eps: float) -> float:
            terms = (1 - torch.exp(eps - L)).clamp_min(0)
            return float(terms.mean()) - zq * float(terms.std()) / math.sqrt(L.numel())

        lo, hi = 0.0, 50.0
        if delta_lower(lo) <= delta:
            continue
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if delta_lower(mid) > delta else (lo, mid)
        best = max(best, lo)
    return best
