"""Accounting of the Skellam mechanism (distributed DP) by Rényi DP.

The bound is Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private Federated
Learning" (NeurIPS 2021), Theorem 3.5 / Corollary 3.6, written with the noise's variance V per
coordinate (each of the two Poissons has mean V/2): for every integer order α > 1 and integer
inputs of L2 sensitivity Δ₂ and L1 sensitivity Δ₁,

    ε(α) ≤ α·Δ₂²/(2V) + min(((2α − 1)·Δ₂² + 6·Δ₁)/(4V²), 3·Δ₁/(2V)).

The first term is the Gaussian's RDP at the same variance; the second is what integers cost.
Sensitivities are those of the replace-one pair (the ledger records them so), so no conversion
is made. Orders are integers only (the theorem's range). A composition that holds a Skellam
release is accounted whole in RDP, its Gaussian releases included (a replace-one Gaussian with
noise multiplier z has ε(α) = 2α/z², exactly); RDP to (ε, δ) is dp-accounting's conversion.
tests/test_distributed.py checks the bound against the privacy loss of the two explicit PMFs of
a worst-case one-dimensional pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

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


def event_rdp(event: dp_accounting.DpEvent, orders: Sequence[int] = ORDERS) -> np.ndarray:
    """RDP curve of a replace-one event at ``orders``; a ValueError for what it cannot bound."""
    orders_arr = np.asarray(orders, dtype=np.float64)
    if isinstance(event, SkellamDpEvent):
        return np.array([skellam_rdp(a, event.variance, event.l2_sensitivity, event.l1_sensitivity) for a in orders])
    if isinstance(event, dp_accounting.GaussianDpEvent):
        z = event.noise_multiplier
        return np.full(len(orders), math.inf) if z == 0 else 2.0 * orders_arr / z**2
    if isinstance(event, PureDpEvent):
        # ε-DP implies (ε²/2)-zCDP (Bun & Steinke 2016, Prop. 1.4): RDP α·ε²/2, and never above ε
        return np.minimum(orders_arr * event.epsilon**2 / 2, event.epsilon)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum((event_rdp(e, orders) for e in event.events), np.zeros(len(orders)))
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * event_rdp(event.event, orders)
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return np.zeros(len(orders))
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return np.full(len(orders), math.inf)
    raise ValueError(
        f"the Skellam RDP accountant cannot account a {type(event).__name__} (distributed DP runs without "
        "Poisson sampling or stated (ε, δ) releases)"
    )


def rdp_epsilon(event: dp_accounting.DpEvent, delta: float, orders: Sequence[int] = ORDERS) -> float:
    """ε at ``delta`` of ``event`` composed in RDP (dp-accounting's RDP → (ε, δ) conversion)."""
    rdp = event_rdp(event, orders)
    if not np.isfinite(rdp).any():
        return math.inf
    eps, _ = rdp_privacy_accountant.compute_epsilon(list(map(float, orders)), list(rdp), delta)
    return float(eps)
