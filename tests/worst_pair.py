"""Direct privacy-loss computation for a Poisson-sampled Gaussian on a given neighbouring pair.

One unit sits at ``a`` (dataset D) or at ``a2`` (D′), in units of the noise std σ; with
probability 1 − q it is not sampled. The released sum's law, projected on span(a, a2) (the
orthogonal directions carry the same noise on both sides and cancel), is the 2-D mixture

    P = (1 − q)·N(0, I) + q·N(a, I)        Q = (1 − q)·N(0, I) + q·N(a2, I).

δ(ε) = max over the two orders of ∫ (p − e^ε q)₊ is computed by quadrature on a grid (step h,
±``span`` σ around the points: the tails beyond carry < 1e-14), independent of dp-accounting.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize


def _grid(a: np.ndarray, a2: np.ndarray, h: float, span: float):
    lo = np.minimum(np.minimum(a, a2), 0.0) - span
    hi = np.maximum(np.maximum(a, a2), 0.0) + span
    xs = np.arange(lo[0], hi[0] + h, h)
    ys = np.arange(lo[1], hi[1] + h, h)
    return np.meshgrid(xs, ys, indexing="ij")


def log_densities(q: float, a, a2, h: float = 0.01, span: float = 9.0):
    """log p, log q on the grid and the cell area (unnormalised Gaussian constants cancel)."""
    a, a2 = np.asarray(a, float), np.asarray(a2, float)
    X, Y = _grid(a, a2, h, span)

    def log_mix(c: np.ndarray) -> np.ndarray:
        d0 = -(X**2 + Y**2) / 2
        d1 = -((X - c[0]) ** 2 + (Y - c[1]) ** 2) / 2
        return np.logaddexp(math.log1p(-q) + d0, math.log(q) + d1) if q < 1 else d1

    return log_mix(a) - math.log(2 * math.pi), log_mix(a2) - math.log(2 * math.pi), h * h


def delta_of(eps: float, lp: np.ndarray, lq: np.ndarray, area: float) -> float:
    """max over both orders of ∫ (p − e^ε q)₊."""
    p, q = np.exp(lp), np.exp(lq)
    return float(
        max(np.clip(p - math.exp(eps) * q, 0, None).sum(), np.clip(q - math.exp(eps) * p, 0, None).sum()) * area
    )


def epsilon_of(delta: float, q: float, a, a2, h: float = 0.01) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` on this pair (bisection; δ(ε) is decreasing)."""
    lp, lq, area = log_densities(q, a, a2, h)
    if delta_of(0.0, lp, lq, area) <= delta:
        return 0.0
    hi = 1.0
    while delta_of(hi, lp, lq, area) > delta:
        hi *= 2
    return float(optimize.brentq(lambda e: delta_of(e, lp, lq, area) - delta, 0.0, hi, xtol=1e-6))


def pair_pld(q: float, a, a2, h: float = 0.01, interval: float = 1e-4):
    """dp-accounting PLD of this pair's privacy loss (tabulated on the grid, rounded up, so
    pessimistic); for composing a whole run's worst case. Assumes a symmetric pair (|a| = |a2|)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    lp, lq, area = log_densities(q, a, a2, h)
    loss = (lp - lq).ravel()
    mass = np.exp(lp).ravel() * area
    index = np.ceil(loss / interval).astype(np.int64)
    keys, inverse = np.unique(index, return_inverse=True)
    table = np.bincount(inverse, weights=mass)
    pmf = {int(k): float(v) for k, v in zip(keys, table, strict=True) if v > 0}
    return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
        pmf, max(0.0, 1.0 - float(table.sum())), interval
    )
