"""MMCC: amplification by Poisson sampling for a matrix mechanism with any non-negative lower-triangular C.

Choquette-Choo, Ganesh, Steinke and Thakurta, "Privacy Amplification for Matrix Mechanisms", ICLR 2024
(arXiv 2310.15526). The stream releases C·x + z (z ~ N(0, σ²I)); each unit takes part in each of the T
rounds independently with probability q. Under add/remove neighbours, for C with non-negative entries
the unit's worst case is one coordinate with every participation at the full bound (clip 1), so the
pair is P = N(0, σ²I) against Q = E_b N(C·b, σ²I), b_j ~ Bernoulli(q) independently.

Conditional composition (the paper's Theorem 3.1): round i's output given the earlier ones is, under Q,
a mixture of N(Σ_j C_ij·b_j, σ²) over the posterior of b_<i. For j < i with C_ij > 0, the posterior
odds that b_j = 1 given the earlier outputs *and any values of the other b's* are q/(1 − q) times the
likelihood ratio exp((⟨y − C·s, c_j⟩ − ‖c_j‖²/2)/σ²) (c_j: column j on rows < i). With C ≥ 0,
⟨C·(b − s), c_j⟩ ≤ G_ij = ⟨C·1, c_j⟩ whatever b and s, and ⟨z, c_j⟩ ≤ σ‖c_j‖·Φ⁻¹(1 − δ_ij) except with
probability δ_ij, under P as under Q. So, except with probability δ_ij, b_j's conditional probability
is at most p̃_ij = q·e^ε̃/(q·e^ε̃ + 1 − q), ε̃_ij = (G_ij − ‖c_j‖²/2 + σ‖c_j‖Φ⁻¹(1 − δ_ij))/σ². Drawn
one after another, the b_<i are then coupled below independent Bernoulli(p̃_ij), and round i is
dominated by the mixture of Gaussians Σ_j C_ij·B_j + C_ii·B_i (B_j ~ Bernoulli(p̃_ij), B_i ~
Bernoulli(q)) against N(0, σ²) (the paper's monotonicity of mixtures of Gaussians in the sensitivity's
distribution). The T rounds compose as dp-accounting's ``MixtureOfGaussiansDpEvent`` PLDs, and every
tail bound's failure probability is charged to δ explicitly: ε(δ) = ε_PLD(δ − Σ_ij δ_ij).

A round whose row has no earlier non-zero entry (C = I: every round) needs no tail bound and charges
nothing: for C = I the result is exactly T Poisson-sampled Gaussians. Shifts are rounded up (never down)
onto a grid when a row has many non-zero entries, which only enlarges the mixture's shifts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attr
import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import special, stats

EXACT_TERMS = 8
"""A row with at most this many random terms has its mixture enumerated exactly (2^terms shifts);
beyond, its shifts are rounded up onto :data:`SHIFT_GRID` points."""
SHIFT_GRID = 256
TAIL_SHARES = (0.5, 0.1, 0.01)
"""The shares of δ an ε computation tries for the tail bounds (each a valid guarantee; the smallest ε is
reported)."""


@attr.s(frozen=True, slots=True, auto_attribs=True)
class MatrixMechanismDpEvent(dp_accounting.DpEvent):
    """T rounds of C·x + z with Poisson sampling (MMCC): C the T×T lower-triangular Toeplitz matrix whose
    first column starts with ``coefficients`` (non-negative, c_0 > 0, then zeros), each unit in each
    round with probability ``sampling_probability``, and z's std ``noise_multiplier`` times the per-unit
    bound. dp-accounting has no such event; the ``mmcc`` accountant expands it (:func:`row_events`)."""

    coefficients: tuple[float, ...]
    horizon: int
    sampling_probability: float
    noise_multiplier: float


def check_event(event: MatrixMechanismDpEvent) -> None:
    """Refuse an event MMCC's analysis does not cover, naming the field and the allowed range."""
    c = event.coefficients
    if not c or c[0] <= 0 or any(not math.isfinite(v) or v < 0 for v in c):
        raise ValueError(f"coefficients must be finite and non-negative with c_0 > 0 (MMCC needs C ≥ 0); got {c}")
    if event.horizon < 1:
        raise ValueError(f"horizon must be >= 1; got {event.horizon}")
    if not 0.0 <= event.sampling_probability <= 1.0:
        raise ValueError(f"sampling_probability must be in [0, 1]; got {event.sampling_probability}")
    if not event.noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0; got {event.noise_multiplier}")


def toeplitz_matrix(coefficients: Sequence[float], horizon: int) -> np.ndarray:
    """The T×T lower-triangular Toeplitz C whose first column starts with ``coefficients``."""
    col = np.zeros(horizon)
    head = np.asarray(coefficients[:horizon], dtype=np.float64)
    col[: head.size] = head
    idx = np.subtract.outer(np.arange(horizon), np.arange(horizon))
    return np.where(idx >= 0, col[np.clip(idx, 0, None)], 0.0)


def tail_pairs(C: np.ndarray) -> int:
    """How many tail bounds MMCC takes for C: the entries C_ij > 0 with j < i."""
    return int(np.count_nonzero(np.tril(C, -1) > 0))


def posterior_bounds(C: np.ndarray, i: int, q: float, sigma: float, pair_delta: float) -> np.ndarray:
    """p̃_ij for every j < i (0 where C_ij = 0): the bound on b_j's probability given round i's past,
    except with probability ``pair_delta`` each (module docstring)."""
    out = np.zeros(i)
    if i == 0:
        return out
    past = C[:i, :i]  # rows < i; a column k ≥ i is zero there
    load = past.sum(axis=1)  # C·1 on rows < i
    z_tail = float(stats.norm.isf(pair_delta))
    logit_q = math.log(q) - math.log1p(-q) if 0 < q < 1 else math.inf
    for j in range(i):
        if C[i, j] <= 0:
            continue
        col = past[:, j]
        norm = float(np.linalg.norm(col))
        eps = (float(load @ col) - norm**2 / 2 + sigma * norm * z_tail) / sigma**2
        out[j] = 1.0 if q >= 1 else float(special.expit(eps + logit_q))
    return out


def mixture(shifts: Sequence[float], probs: Sequence[float]) -> tuple[list[float], list[float]]:
    """The distribution of Σ_k shifts_k·B_k, B_k ~ Bernoulli(probs_k) independent, as (values, masses):
    exact for up to :data:`EXACT_TERMS` terms, else each value rounded up onto a grid of
    :data:`SHIFT_GRID` steps (never down: a larger shift only weakens the bound's claim)."""
    terms = [(float(s), float(p)) for s, p in zip(shifts, probs, strict=True) if s > 0 and p > 0]
    if not terms:
        return [0.0], [1.0]
    if len(terms) <= EXACT_TERMS:
        values, masses = np.zeros(1), np.ones(1)
        for s, p in terms:
            values = np.concatenate([values, values + s])
            masses = np.concatenate([masses * (1 - p), masses * p])
        keyed: dict[float, float] = {}
        for v, m in zip(values.tolist(), masses.tolist(), strict=True):
            if m > 0:
                keyed[v] = keyed.get(v, 0.0) + m
        return list(keyed), list(keyed.values())
    total = sum(s for s, _ in terms)
    step = total / SHIFT_GRID
    pmf = np.ones(1)
    for s, p in terms:
        k = math.ceil(s / step - 1e-12)  # rounded up
        shifted = np.zeros(pmf.size + k)
        shifted[: pmf.size] += pmf * (1 - p)
        shifted[k:] += pmf * p
        pmf = shifted
    keep = np.nonzero(pmf > 0)[0]
    return (keep * step).tolist(), pmf[keep].tolist()


def rows(
    event: MatrixMechanismDpEvent, tail_delta: float
) -> tuple[list[tuple[tuple[float, ...], tuple[float, ...]]], float]:
    """Each round's dominating mixture of Gaussians as (shifts, probabilities) per unit bound, and the δ
    its tail bounds charge (``tail_delta`` split evenly over :func:`tail_pairs`; 0 when no round has an
    earlier non-zero entry, C = I among them)."""
    check_event(event)
    q, sigma = event.sampling_probability, event.noise_multiplier
    C = toeplitz_matrix(event.coefficients, event.horizon)
    pairs = tail_pairs(C)
    pair_delta = tail_delta / pairs if pairs else 0.0
    out = []
    for i in range(event.horizon):
        past = posterior_bounds(C, i, q, sigma, pair_delta) if np.any(C[i, :i] > 0) else np.zeros(i)
        values, masses = mixture([*C[i, :i].tolist(), float(C[i, i])], [*past.tolist(), q])
        out.append((tuple(values), tuple(masses)))
    return out, (tail_delta if pairs else 0.0)


def _interval_mass(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Φ(b) − Φ(a) elementwise, computed on the side of the tail it lies in (no cancellation)."""
    return np.where(b <= 0, special.ndtr(b) - special.ndtr(a), special.ndtr(-a) - special.ndtr(-b))


def _rounded(index: np.ndarray, mass: np.ndarray) -> dict[int, float]:
    base = int(index.min())
    total = np.bincount(index - base, weights=mass)
    return {int(k) + base: float(total[k]) for k in np.nonzero(total > 0)[0]}


def mixture_pld(
    sigma: float,
    shifts: Sequence[float],
    probs: Sequence[float],
    discretisation: float,
    *,
    tail: float = 12.0,
    points: int = 50_000,
) -> pld_lib.PrivacyLossDistribution:
    """A pessimistic PLD of N(0, σ²) against Σ_k probs_k·N(shifts_k, σ²) (shifts ≥ 0), both directions.

    The loss L(y) = log Σ_k p_k·exp((y·s_k − s_k²/2)/σ²) is increasing in y. On a grid of y, each
    interval's mass (exact, from Φ) is put at the interval's largest loss rounded up to the PLD's grid
    (L at its right end under the mixture, −L at its left end under N(0, σ²)); the mass outside
    [−tail·σ, max shift + tail·σ] is put at infinity. Every step rounds towards more loss, so the result
    upper-bounds the hockey-stick divergences (dp-accounting's own ``from_mixture_gaussian_mechanism``
    does the same on its own grid, ~50× slower; tests/test_mmcc.py compares them). The mixture
    direction is dp-accounting's REMOVE, the other its ADD (as its mixture event)."""
    s, w = np.asarray(shifts, dtype=np.float64), np.asarray(probs, dtype=np.float64)
    top = float(s.max())
    lo, hi = -tail * sigma, top + tail * sigma
    step = max(discretisation * sigma**2 / max(top, 1e-12), (hi - lo) / points)
    y = np.append(np.arange(lo, hi, step), hi)
    loss = special.logsumexp((np.outer(y, s) - s**2 / 2) / sigma**2, b=w, axis=1)
    a, b = y[:-1], y[1:]
    under_q = (w[None, :] * _interval_mass((a[:, None] - s) / sigma, (b[:, None] - s) / sigma)).sum(axis=1)
    under_p = _interval_mass(a / sigma, b / sigma)
    up = np.ceil(loss[1:] / discretisation - 1e-9).astype(np.int64)
    down = np.ceil(-loss[:-1] / discretisation - 1e-9).astype(np.int64)
    outside_q = float((w * (special.ndtr((lo - s) / sigma) + special.ndtr((s - hi) / sigma))).sum())
    outside_p = float(special.ndtr(lo / sigma) + special.ndtr(-hi / sigma))
    return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
        _rounded(up, under_q),
        outside_q,
        discretisation,
        rounded_probability_mass_function_add=_rounded(down, under_p),
        infinity_mass_add=outside_p,
        symmetric=False,
    )


def stream_pld(
    event: MatrixMechanismDpEvent, tail_delta: float, discretisation: float
) -> tuple[pld_lib.PrivacyLossDistribution | None, float]:
    """The composed PLD of the event's rounds (:func:`rows`; equal rounds self-composed once) and the δ
    its tail bounds charge; None for a stream without noise (not private)."""
    if event.noise_multiplier == 0:
        return None, 0.0
    found, charged = rows(event, tail_delta)
    counts: dict[tuple[tuple[float, ...], tuple[float, ...]], int] = {}
    for r in found:
        counts[r] = counts.get(r, 0) + 1
    out: pld_lib.PrivacyLossDistribution | None = None
    for (shifts, probs), n in counts.items():
        if len(shifts) == 2 and shifts[0] == 0.0:
            # one random term: a Poisson-sampled Gaussian, dp-accounting's own (exactly its PLD accountant's)
            one = pld_lib.from_gaussian_mechanism(
                event.noise_multiplier / shifts[1],
                sampling_prob=probs[1],
                value_discretization_interval=discretisation,
            )
        elif len(shifts) == 1:
            one = (
                pld_lib.from_gaussian_mechanism(
                    event.noise_multiplier / shifts[0], value_discretization_interval=discretisation
                )
                if shifts[0] > 0
                else pld_lib.identity(discretisation)
            )
        else:
            one = mixture_pld(event.noise_multiplier, shifts, probs, discretisation)
        one = one.self_compose(n) if n > 1 else one
        out = one if out is None else out.compose(one)
    return out, charged
