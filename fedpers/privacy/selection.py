"""Private selection's randomness: a random number of repetitions (Papernot & Steinke 2022).

A hyper-parameter search that runs each candidate once and keeps the best leaks through the
choice; running a *random* number K of trials, each on a uniformly drawn candidate, and
releasing only the best keeps the cost close to one run. K follows the truncated negative
binomial TNB(η, γ) of Papernot & Steinke 2022 (η = 1 is the geometric law of Liu & Talwar 2019,
η = 0 the logarithmic, η = ∞ the Poisson); dp-accounting's ``RepeatAndSelectDpEvent(event,
mean, shape=η)`` accounts it (RDP, their Theorems 2 and 6). The draws here come from the
server's generator (the Privatizer's), since K itself must stay secret.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import optimize, special


def tnb_gamma(mean: float, shape: float) -> float:
    """γ of TNB(η = ``shape``, γ) with the given mean (Papernot & Steinke 2022, Definition 1):
    mean = η(1−γ)/(γ(1−γ^η)) for η > 0, (1−γ)/(γ·log(1/γ)) for η = 0."""
    if not mean > 1:
        raise ValueError(f"mean number of repetitions must be > 1, got {mean}")
    if not (shape >= 0 and math.isfinite(shape)):
        raise ValueError(f"shape must be finite and >= 0 here, got {shape}")

    def mean_of(g: float) -> float:
        if shape == 0:
            return (1 - g) / (g * math.log(1 / g))
        return shape * (1 - g) / (g * (1 - g**shape))

    return float(optimize.brentq(lambda g: mean_of(g) - mean, 1e-12, 1 - 1e-12, xtol=1e-15))


def tnb_pmf(k: np.ndarray, mean: float, shape: float) -> np.ndarray:
    """P(K = k), k ≥ 1: ∝ (1−γ)^k Γ(k+η)/(k! Γ(η)) (for η = 0: (1−γ)^k/k)."""
    k = np.asarray(k, dtype=np.float64)
    g = tnb_gamma(mean, shape)
    if shape == 0:
        return (1 - g) ** k / (k * math.log(1 / g))
    log_p = k * math.log1p(-g) + special.gammaln(k + shape) - special.gammaln(k + 1) - special.gammaln(shape)
    return np.exp(log_p) * g**shape / (1 - g**shape)


def tnb_pgf(x: float, mean: float, shape: float) -> float:
    """E[x^K] (used to state the selection's law: P(best of K uniform draws ranks ≤ r))."""
    g = tnb_gamma(mean, shape)
    if shape == 0:
        return math.log1p(-(1 - g) * x) / math.log(g)
    return ((1 - (1 - g) * x) ** -shape - 1) / (g**-shape - 1)


def repetitions(generator: torch.Generator, mean: float, shape: float) -> int:
    """One draw of K ~ TNB(shape, γ(mean)) by inversion of its CDF with one uniform from ``generator``."""
    if math.isinf(shape):
        raise ValueError("shape = inf (Poisson repetitions) is not offered: its cost grows fast with the mean")
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    total, k, block = 0.0, 1, 256
    while True:
        ks = np.arange(k, k + block)
        cdf = total + np.cumsum(tnb_pmf(ks, mean, shape))
        hit = np.nonzero(cdf >= u)[0]
        if hit.size:
            return int(ks[hit[0]])
        total, k = float(cdf[-1]), k + block
        if k > 10**7:
            return k
