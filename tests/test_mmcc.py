"""MMCC (Choquette-Choo, Ganesh, Steinke, Thakurta, ICLR 2024) for Poisson sampling every round: one band is
plain Poisson-subsampled Gaussian accounting, the stream's ε against an independent computation (dense C,
every row's mixture enumerated, dp-accounting's own mixture-of-Gaussians PLD), never below a Monte Carlo
lower estimate of the mechanism's own privacy loss (which catches a halved noise scale), calibration, and
refusals."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import special, stats

from fedpers.configs.privacy import CAPABILITIES
from fedpers.privacy import correlated as cc
from fedpers.privacy import mmcc
from fedpers.privacy.accountant import UnsupportedEvent, calibrate_noise_multiplier, event_epsilon
from tests.monte_carlo import mc_epsilon_lower

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def mmcc_epsilon(event: dp_accounting.DpEvent, delta: float, grid: float = 1e-4) -> float:
    return event_epsilon(event, delta, "mmcc", neighbours="add-remove", pld_discretisation=grid)


@pytest.mark.parametrize("T, q, z", [(8, 0.25, 1.0), (32, 0.0625, 2.5), (5, 1.0, 3.0)])
def test_one_band_is_exactly_plain_poisson_accounting(T, q, z):
    """C = I: no round has an earlier entry, nothing is charged to δ, and ε is the PLD accountant's own."""
    stream = mmcc.MatrixMechanismDpEvent((1.0,), T, q, z)
    assert mmcc.tail_pairs(mmcc.toeplitz_matrix((1.0,), T)) == 0
    plain = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), T
    )
    assert mmcc_epsilon(stream, 1e-5) == event_epsilon(plain, 1e-5, "pld", neighbours="add-remove")


# ----- an independent computation of the same bound ------------------------------------------------
def independent_epsilon(coefficients: tuple[float, ...], T: int, q: float, z: float, delta: float, share: float):
    """MMCC's bound recomputed from its definition: the dense C, each posterior bound from the tail of
    ⟨z, c_j⟩ (scipy's normal quantile) and the all-participate load, each row's mixture enumerated over
    every subset, composed by dp-accounting's own ``MixtureOfGaussiansDpEvent`` PLD at δ − share·δ."""
    C = np.zeros((T, T))
    for i in range(T):
        for j in range(i + 1):
            if i - j < len(coefficients):
                C[i, j] = coefficients[i - j]
    pairs = sum(1 for i in range(T) for j in range(i) if C[i, j] > 0)
    pair_delta = share * delta / pairs
    events = []
    for i in range(T):
        probs = [q] * (i + 1)
        for j in range(i):
            if C[i, j] > 0:
                col = C[:i, j]
                load = sum(C[r, k] * col[r] for r in range(i) for k in range(T))
                eps = (load - col @ col / 2 + z * math.sqrt(col @ col) * stats.norm.ppf(1 - pair_delta)) / z**2
                probs[j] = q * math.exp(eps) / (q * math.exp(eps) + 1 - q)
        used = [j for j in range(i + 1) if C[i, j] > 0]
        shifts, masses = [], []
        for bits in itertools.product((0, 1), repeat=len(used)):
            shifts.append(sum(C[i, j] for j, bit in zip(used, bits, strict=True) if bit))
            masses.append(math.prod(probs[j] if bit else 1 - probs[j] for j, bit in zip(used, bits, strict=True)))
        events.append(dp_accounting.dp_event.MixtureOfGaussiansDpEvent(z, shifts, masses))
    acc = dp_accounting.pld.PLDAccountant(ADD_REMOVE, value_discretization_interval=1e-3)
    acc.compose(dp_accounting.ComposedDpEvent(events))
    return acc.get_epsilon(delta - share * delta)


CROSS = [  # (coefficients, T, q, z): the banded square root and an optimised strategy, 2-3 bands
    ((1.0, 0.5), 6, 0.25, 2.0),
    ((1.0, 0.5, 0.375), 6, 0.1, 1.5),
    (tuple(float(c) for c in cc.optimised_coefficients(6, 2, 2, patterns=cc.single_participation(6))), 6, 0.5, 3.0),
]


@pytest.mark.slow  # 30-90 s each: dp-accounting's own mixture PLDs, one per round
@pytest.mark.parametrize("coefficients, T, q, z", CROSS)
def test_the_stream_equals_an_independent_computation(coefficients, T, q, z):
    delta, share = 1e-5, 0.1
    pld, charged = mmcc.stream_pld(mmcc.MatrixMechanismDpEvent(coefficients, T, q, z), share * delta, 1e-3)
    assert pld is not None and charged == pytest.approx(share * delta)
    ours = pld.get_epsilon_for_delta(delta - charged)
    theirs = independent_epsilon(coefficients, T, q, z, delta, share)
    assert ours == pytest.approx(theirs, rel=2e-3)  # two pessimistic PLD constructions of one bound
    assert ours >= theirs * (1 - 2e-3)


def test_the_mixture_pld_bounds_dp_accountings_own_from_above_and_tightly():
    """The fast mixture PLD against dp-accounting's ``from_mixture_gaussian_mechanism`` (both directions)."""
    sigma, shifts, probs = 2.0, (0.0, 0.5, 1.0, 1.5), (0.5, 0.2, 0.2, 0.1)
    ours = mmcc.mixture_pld(sigma, shifts, probs, 1e-3).self_compose(8)
    theirs = pld_lib.from_mixture_gaussian_mechanism(sigma, shifts, probs, value_discretization_interval=1e-3)
    theirs = theirs.self_compose(8)
    for delta in (1e-3, 1e-6):
        a, b = ours.get_epsilon_for_delta(delta), theirs.get_epsilon_for_delta(delta)
        assert b * (1 - 1e-3) <= a <= b * (1 + 5e-3)


# ----- the mechanism's own privacy loss ------------------------------------------------------------
def test_mmcc_is_never_below_a_monte_carlo_lower_estimate_and_a_halved_scale_is_caught():
    """6 rounds of the 2-band square root, every unit in every round with q = 0.5, σ = 1, at δ = 1e-2: the
    64-component mixture evaluated in the full 6 dimensions, both directions of the hockey stick."""
    coefficients, T, q, sigma, delta = (1.0, 0.5), 6, 0.5, 1.0, 1e-2
    accounted = mmcc_epsilon(mmcc.MatrixMechanismDpEvent(coefficients, T, q, sigma), delta, grid=1e-3)
    C = torch.tensor(mmcc.toeplitz_matrix(coefficients, T))
    lower = mc_epsilon_lower(C, sigma, 1.0, q, 1, delta, "add-remove", samples=100_000)
    assert lower <= accounted
    assert mc_epsilon_lower(C, sigma / 2, 1.0, q, 1, delta, "add-remove", samples=100_000) > accounted


@pytest.mark.slow  # ~40-80 s: two calibrations, each ~20 MMCC evaluations
def test_calibration_meets_the_target_and_more_bands_cost_noise_at_large_q():
    T, q, delta = 8, 0.25, 1e-5

    def stream(coefficients: tuple[float, ...]):
        return lambda z: mmcc.MatrixMechanismDpEvent(coefficients, T, q, z)

    z1 = calibrate_noise_multiplier(stream((1.0,)), 2.0, delta, "mmcc", neighbours="add-remove")
    z2 = calibrate_noise_multiplier(stream((1.0, 0.5)), 2.0, delta, "mmcc", neighbours="add-remove")
    assert 2.0 * (1 - 2e-3) <= mmcc_epsilon(stream((1.0, 0.5))(z2), delta) <= 2.0
    assert z2 > z1  # a second band's coupling is paid for in the posterior bounds


def test_refusals_name_the_field():
    assert CAPABILITIES["mmcc"] == (("add-remove",), ("add-remove",))
    stream = mmcc.MatrixMechanismDpEvent((1.0, 0.5), 4, 0.5, 1.0)
    with pytest.raises(ValueError, match="add-remove"):
        event_epsilon(stream, 1e-5, "mmcc")  # replace-one: not the paper's relation
    with pytest.raises(ValueError, match="non-negative"):
        mmcc_epsilon(mmcc.MatrixMechanismDpEvent((1.0, -0.5), 4, 0.5, 1.0), 1e-5)
    with pytest.raises(ValueError, match="sampling_probability"):
        mmcc_epsilon(mmcc.MatrixMechanismDpEvent((1.0,), 4, 1.5, 1.0), 1e-5)
    with pytest.raises(UnsupportedEvent):
        event_epsilon(stream, 1e-5, "pld", neighbours="add-remove")  # only the mmcc accountant knows it
    assert mmcc_epsilon(mmcc.MatrixMechanismDpEvent((1.0, 0.5), 4, 0.5, 0.0), 1e-5) == math.inf


def test_posterior_bounds_follow_the_formula_and_shifts_round_up():
    C = mmcc.toeplitz_matrix((1.0, 0.5), 4)
    p = mmcc.posterior_bounds(C, 2, 0.25, 2.0, 1e-6)
    col = C[:2, 1]
    eps = (C[:2].sum(1) @ col - col @ col / 2 + 2.0 * np.linalg.norm(col) * stats.norm.isf(1e-6)) / 4.0
    assert p[0] == 0.0 and p[1] == pytest.approx(special.expit(eps + math.log(0.25 / 0.75)), rel=1e-12)
    many = [0.1 * (k + 1) for k in range(mmcc.EXACT_TERMS + 2)]
    values, masses = mmcc.mixture(many, [0.3] * len(many))
    assert sum(masses) == pytest.approx(1.0) and max(values) >= sum(many) * (1 - 1e-12)
    # the rounded distribution dominates the exact one: its mean is at least the exact mean
    assert float(np.dot(values, masses)) >= 0.3 * sum(many) * (1 - 1e-12)
