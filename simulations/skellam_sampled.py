"""Poisson-sampled Skellam ε (docs/accounting.md, "Skellam with Poisson cohorts"): for the configurations of
tests/test_skellam_sampled.py, under both neighbouring relations, fedpers's ε beside the test's independent
implementation of the two theorems (60-digit arithmetic, orders 2..64, dp-accounting's RDP → (ε, δ)) and the
exact ε of the sampled one-dimensional worst-case pair from its explicit PMFs.

    PYTHONPATH=$PWD python simulations/skellam_sampled.py
"""

from __future__ import annotations

from typing import Any

import dp_accounting
import mpmath
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from fedpers.privacy import skellam
from fedpers.privacy.ledger import SkellamDpEvent
from tests.test_skellam_sampled import (
    CONFIGS,
    DELTA,
    _exact_epsilon,
    _skellam_rdp,
    _wang_balle_kasiviswanathan,
    _zhu_wang,
)

ORDERS = list(range(2, 65))


def main() -> None:
    mpmath.mp.dps = 60
    print(f"δ = {DELTA}; orders 2..64 for both columns of the bound")
    print("| relation | Skellam V | Δ₂ = Δ₁ | q | rounds | fedpers ε | independent ε | exact 1-D ε | ε unsampled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for relation, theorem in (("replace-one", _wang_balle_kasiviswanathan), ("add-remove", _zhu_wang)):
        for variance, shift, q, rounds in CONFIGS:
            c = shift // 2
            sens = shift if relation == "replace-one" else c
            inner = SkellamDpEvent(variance, sens, sens)

            def eps(a: int, sens: float = sens, variance: float = variance) -> Any:
                return _skellam_rdp(a, variance, sens, sens)

            event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, inner), rounds)
            ours = skellam.rdp_epsilon(event, DELTA, ORDERS, relation)
            curve = np.array([float(theorem(a, q, eps)) for a in ORDERS]) * rounds
            independent, _ = rdp_privacy_accountant.compute_epsilon(ORDERS, list(curve), DELTA)
            exact = _exact_epsilon(variance, -c, c, q, rounds) if relation == "replace-one" else None
            if exact is None:
                exact = _exact_epsilon(variance, c, 0, q, rounds)
            plain = skellam.rdp_epsilon(dp_accounting.SelfComposedDpEvent(inner, rounds), DELTA, ORDERS, relation)
            print(
                f"| {relation} | {variance:g} | {sens} | {q:g} | {rounds} | {ours:.6f} | {independent:.6f} | "
                f"{exact:.4f} | {plain:.4f} |"
            )


if __name__ == "__main__":
    main()
