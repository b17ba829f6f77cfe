"""Empirical privacy audit: a statistical lower bound on μ (μ-GDP) from two neighbouring inputs.

Run a release many times on neighbours D and D', project each output on the direction
that separates them, threshold, and bound TPR from below and FPR from above with
one-sided Clopper–Pearson intervals. Any (ε, δ)/μ-GDP mechanism must satisfy
Φ⁻¹(TPR) − Φ⁻¹(FPR) ≤ μ, so a lower bound above the claimed μ proves the claim wrong
(with the stated confidence).
"""
from __future__ import annotations

from typing import Callable

import torch
from scipy import stats

Tensor = torch.Tensor


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """One-sided (lower, upper) bounds, each holding with probability ``confidence``."""
    alpha = 1 - confidence
    lo = 0.0 if successes == 0 else float(stats.beta.ppf(alpha, successes, trials - successes + 1))
    hi = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha, successes + 1, trials - successes))
    return lo, hi


def gdp_lower_bound(
    release_d: Callable[[], Tensor],
    release_d_prime: Callable[[], Tensor],
    center_d: Tensor,
    center_d_prime: Tensor,
    trials: int = 1000,
    confidence: float = 0.975,
) -> float:
    """Lower bound on μ from ``trials`` releases on each neighbour (threshold at the midpoint)."""
    direction = (center_d - center_d_prime).flatten().double()
    gap = float(torch.linalg.vector_norm(direction))
    if gap == 0:
        return 0.0
    direction = direction / gap

    def score(release: Callable[[], Tensor]) -> Tensor:
        return torch.stack([((release().flatten().double() - center_d_prime.flatten().double()) @ direction) for _ in range(trials)])

    tp = int((score(release_d) > gap / 2).sum())
    fp = int((score(release_d_prime) > gap / 2).sum())
    tpr_lo, _ = clopper_pearson(tp, trials, confidence)
    _, fpr_hi = clopper_pearson(fp, trials, confidence)
    if tpr_lo <= 0 or fpr_hi >= 1:
        return 0.0
    return max(0.0, float(stats.norm.ppf(tpr_lo) - stats.norm.ppf(fpr_hi)))
