"""Accounting of the Skellam mechanism (distributed DP) by Rényi DP.

The bound is Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private Federated
Learning" (NeurIPS 2021), Theorem 3.5 / Corollary 3.6, written with the noise's variance V per
coordinate (each of the two Poissons has mean V/2): for every integer order α > 1 and integer
inputs of L2 sensitivity Δ₂ and L1 sensitivity Δ₁,

    ε(α) ≤ α·Δ₂²/(2V) + min(((2α − 1)·Δ₂² + 6·Δ₁)/(4V²), 3·Δ₁/(2V)).

The first term is the Gaussian's RDP at the same variance; the second is what integers cost.
Sensitivities are those of the run's neighbouring relation (the ledger records them so: replace-one
Δ₂ = 2c̃, add-remove Δ₂ = c̃), so no conversion is made. Orders are integers only (the theorem's
range). A composition that holds a Skellam release is accounted whole in RDP, its Gaussian releases
included (a Gaussian with noise multiplier z has ε(α) = 2α/z² replace-one, α/(2z²) add-remove,
exactly); RDP to (ε, δ) is dp-accounting's conversion.

**Poisson-sampled releases** (each unit enters a round's sum independently with probability q): the
mechanism's RDP curve ε(·) at the integer orders 2..α is amplified by the general subsampled-RDP
bounds, which hold for any mechanism (dp-accounting's tight bound is for the Gaussian only):

- add-remove: Zhu & Wang, "Poisson Subsampled Rényi Differential Privacy" (ICML 2019), the general
  upper bound (Theorem 5 of the PMLR version), as google-research ``distributed_dp`` accounts its
  sampled Skellam:
  ε'(α) ≤ log[(1−q)^(α−1)(αq − q + 1) + C(α,2)q²(1−q)^(α−2)e^(ε(2)) + 3Σ_{l=3..α} C(α,l)(1−q)^(α−l)q^l e^((l−1)ε(l))]/(α−1);
- replace-one: Wang, Balle & Kasiviswanathan, "Subsampled Rényi Differential Privacy and Analytical
  Moments Accountant" (AISTATS 2019), Theorem 9, with ε(∞) = ∞ (integer noise has no finite one):
  ε'(α) ≤ log[1 + q²C(α,2)·min(4(e^(ε(2)) − 1), 2e^(ε(2))) + 2Σ_{j=3..α} q^j C(α,j) e^((j−1)ε(j))]/(α−1).
  Its proof needs ε(·) to bound every pair among the sample with the unit, with its replacement and
  without it; under Poisson sampling the last is an add-remove pair, whose sensitivities (c̃,
  c̃·min(√D, c̃)) are at most the recorded replace-one ones (2c̃, 2c̃·min(√D, c̃)) — which is why a
  sampled release is never PSD-tightened (its Δ₂ stays 2c̃).

Both are taken as min(ε'(α), ε(α)) (Rényi divergence is jointly quasi-convex, so sampling never
costs more than the unsampled release). tests/test_distributed.py checks the bound against the
privacy loss of the two explicit PMFs of a worst-case one-dimensional pair, and
tests/test_skellam_sampled.py the sampled bounds against an independent implementation and the
exact ε of the sampled one-dimensional mixtures, under both relations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special

from fedpers.config import Neighbours, neighbours_of
from fedpers.privacy.ledger import PureDpEvent, SkellamDpEvent

ORDERS: tuple[int, ...] = (*range(2, 129), *range(136, 513, 8), 768, 1024, 2048, 4096)
"""Integer RDP orders (the Skellam bound holds at integer orders)."""


def skellam_rdp(order: int, variance: float, l2: float, l1: float) -> float:
    """The RDP bound above at one integer order (∞ without noise)."""
    if variance <= 0:
        return math.inf if l2 > 0 else 0.0
    a = float(order)
    return a * l2**2 / (2 * variance) + min(((2 * a - 1) * l2**2 + 6 * l1) / (4 * variance**2), 3 * l1 / (2 * variance))


def contains_skellam(event: dp_accounting.DpEvent) -> bool:
    """Whether ``event`` holds a :class:`SkellamDpEvent` anywhere."""
    if isinstance(event, SkellamDpEvent):
        return True
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(contains_skellam(e) for e in event.events)
    if isinstance(event, (dp_accounting.SelfComposedDpEvent, dp_accounting.PoissonSampledDpEvent)):
        return contains_skellam(event.event)
    return False


def event_rdp(
    event: dp_accounting.DpEvent,
    orders: Sequence[int] = ORDERS,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> np.ndarray:
    """RDP curve of ``event`` under ``neighbours`` at integer ``orders``; a ValueError for what it cannot bound."""
    relation = neighbours_of(neighbours)
    orders_arr = np.asarray(orders, dtype=np.float64)
    if isinstance(event, SkellamDpEvent):
        V, l2, l1 = event.variance, event.l2_sensitivity, event.l1_sensitivity
        if V <= 0:
            return np.full(len(orders), math.inf if l2 > 0 else 0.0)
        # skellam_rdp at every order at once
        return orders_arr * l2**2 / (2 * V) + np.minimum(
            ((2 * orders_arr - 1) * l2**2 + 6 * l1) / (4 * V**2), 3 * l1 / (2 * V)
        )
    if isinstance(event, dp_accounting.GaussianDpEvent):
        z = event.noise_multiplier
        factor = relation.sensitivity_factor
        return np.full(len(orders), math.inf) if z == 0 else factor**2 * orders_arr / (2.0 * z**2)
    if isinstance(event, PureDpEvent):
        # ε-DP implies (ε²/2)-zCDP (Bun & Steinke 2016, Prop. 1.4): RDP α·ε²/2, and never above ε
        return np.minimum(orders_arr * event.epsilon**2 / 2, event.epsilon)
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        return poisson_sampled_rdp(event.event, event.sampling_probability, orders, relation)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum((event_rdp(e, orders, relation) for e in event.events), np.zeros(len(orders)))
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * event_rdp(event.event, orders, relation)
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return np.zeros(len(orders))
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return np.full(len(orders), math.inf)
    raise ValueError(
        f"the Skellam RDP accountant cannot account a {type(event).__name__} (distributed DP runs without "
        "stated (ε, δ) releases)"
    )


def poisson_sampled_rdp(
    inner: dp_accounting.DpEvent,
    q: float,
    orders: Sequence[int] = ORDERS,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> np.ndarray:
    """RDP at ``orders`` of ``inner`` run on a Poisson sample of rate ``q``: the general bound of the
    relation (module docstring: Zhu & Wang 2019 add-remove, Wang, Balle & Kasiviswanathan 2019
    replace-one), never above the unsampled curve. ``inner``'s whole curve at 2..max(orders) is used."""
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1]; got {q}")
    relation = neighbours_of(neighbours)
    plain = event_rdp(inner, orders, relation)
    if q == 1.0:
        return plain
    top = int(max(orders))
    curve = event_rdp(inner, range(2, top + 1), relation)  # curve[l − 2] = ε(l)
    log_factorial = special.gammaln(np.arange(top + 1, dtype=np.float64) + 1)
    out = np.empty(len(orders))
    for i, order in enumerate(orders):
        a = int(order)
        if a != order or a < 2:
            raise ValueError(f"the subsampled RDP bounds hold at integer orders ≥ 2; got {order}")
        out[i] = min(_sampled_bound(a, q, curve, log_factorial, relation), plain[i])
    return out


def _sampled_bound(a: int, q: float, curve: np.ndarray, log_factorial: np.ndarray, relation: Neighbours) -> float:
    """The bound at order ``a`` in log space (``curve[l − 2]`` = ε(l), ``log_factorial[n]`` = log n!); ∞
    where ε(l) is for some l ≤ a."""
    if not np.isfinite(curve[: a - 1]).all():
        return math.inf
    ls = np.arange(3, a + 1)
    eps_l = curve[1 : a - 1]  # ε(3..a)
    log_comb = log_factorial[a] - log_factorial[ls] - log_factorial[a - ls]
    e2 = float(curve[0])
    log_q = math.log(q)
    if relation is Neighbours.ADD_REMOVE:
        log1q = math.log1p(-q)
        head = [
            (a - 1) * log1q + math.log(a * q - q + 1),
            math.log(a * (a - 1) / 2) + 2 * log_q + (a - 2) * log1q + e2,
        ]
        rest = math.log(3.0) + log_comb + (a - ls) * log1q + ls * log_q + (ls - 1) * eps_l
    else:
        # min(4(e^ε(2) − 1), 2e^ε(2)) in logs
        second = min(math.log(4.0) + e2 + math.log(-math.expm1(-e2)) if e2 > 0 else -math.inf, math.log(2.0) + e2)
        head = [0.0, math.log(a * (a - 1) / 2) + 2 * log_q + second]
        rest = math.log(2.0) + log_comb + ls * log_q + (ls - 1) * eps_l
    terms = np.concatenate([np.asarray(head), rest])
    peak = float(terms.max())
    total = peak + math.log(float(np.exp(terms - peak).sum()))
    return max(total, 0.0) / (a - 1)


def rdp_epsilon(
    event: dp_accounting.DpEvent,
    delta: float,
    orders: Sequence[int] = ORDERS,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> float:
    """ε at ``delta`` of ``event`` under ``neighbours`` composed in RDP (dp-accounting's RDP → (ε, δ) conversion)."""
    rdp = event_rdp(event, orders, neighbours)
    if not np.isfinite(rdp).any():
        return math.inf
    eps, _ = rdp_privacy_accountant.compute_epsilon(list(map(float, orders)), list(rdp), delta)
    return float(eps)
