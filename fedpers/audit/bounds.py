"""Empirical privacy audits: lower bounds on what a mechanism leaks, from its outputs.

:func:`gdp_lower_bound`: a bound on μ (μ-GDP) from many releases on two neighbouring inputs.
:func:`one_run_lower_bound`: a bound on ε from canaries scored on one run's outputs
(Steinke, Nasr & Jagielski 2023), used by ``fedpers audit`` (:mod:`fedpers.audit.run`).

Run a release many times on neighbours D and D', project each output on the direction
that separates them, threshold, and bound TPR from below and FPR from above with
one-sided Clopper–Pearson intervals. Any (ε, δ)/μ-GDP mechanism must satisfy
Φ⁻¹(TPR) − Φ⁻¹(FPR) ≤ μ, so a lower bound above the claimed μ proves the claim wrong
(with the stated confidence).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy import optimize, special, stats

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
        return torch.stack(
            [((release().flatten().double() - center_d_prime.flatten().double()) @ direction) for _ in range(trials)]
        )

    tp = int((score(release_d) > gap / 2).sum())
    fp = int((score(release_d_prime) > gap / 2).sum())
    tpr_lo, _ = clopper_pearson(tp, trials, confidence)
    _, fpr_hi = clopper_pearson(fp, trials, confidence)
    if tpr_lo <= 0 or fpr_hi >= 1:
        return 0.0
    return max(0.0, float(stats.norm.ppf(tpr_lo) - stats.norm.ppf(fpr_hi)))


GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 1.0)
"""Fractions of the canaries the auditor guesses on (the most extreme scores, half at each end).
Fixed before any score is seen; the confidence is split over them (Bonferroni)."""


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P[≥ ``correct`` right out of ``guesses``] under an (ε, δ)-DP mechanism, for ``canaries``
    canaries each included by an independent fair coin.

    Steinke, Nasr & Jagielski 2023, Theorem 5.2: with f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v],
    P[W ≥ v] ≤ f(v) + 2mδ · max_{1≤i≤v} (f(v−i) − f(v))/i.
    """
    q = float(special.expit(epsilon))
    f_v = float(stats.binom.sf(correct - 1, guesses, q))
    if delta == 0 or correct == 0:
        return min(f_v, 1.0)
    i = np.arange(1, correct + 1)
    alpha = float(np.max((stats.binom.sf(correct - i - 1, guesses, q) - f_v) / i))
    return min(f_v + 2 * canaries * delta * alpha, 1.0)


def one_run_epsilon(canaries: int, guesses: int, correct: int, delta: float, significance: float) -> float:
    """Largest ε whose (ε, δ) claim the observed guesses reject at ``significance`` (0 if none)."""
    if guesses == 0 or one_run_p_value(canaries, guesses, correct, 0.0, delta) > significance:
        return 0.0

    def rejected(eps: float) -> float:
        return significance - one_run_p_value(canaries, guesses, correct, eps, delta)

    hi = 1.0
    while rejected(hi) > 0:
        if hi > 100:
            return hi
        hi *= 2
    return float(optimize.brentq(rejected, 0.0, hi, xtol=1e-6))


def audit_guesses(
    scores: Tensor, included: Tensor, fractions: tuple[float, ...] = GUESS_FRACTIONS
) -> list[tuple[int, int]]:
    """(guesses, correct) for each fraction: guess "included" for the highest scores and
    "left out" for the lowest, half of the guesses at each end."""
    scores, truth = scores.double().flatten(), included.bool().flatten()
    order = torch.argsort(scores)
    m = scores.numel()
    out = []
    for frac in fractions:
        r = max(2, round(frac * m) // 2 * 2) if m >= 2 else m
        low, high = order[: r // 2], order[m - r // 2 :]
        correct = int((~truth[low]).sum()) + int(truth[high].sum())
        out.append((r, correct))
    return out


def one_run_lower_bound(
    scores: Tensor,
    included: Tensor,
    delta: float,
    confidence: float = 0.95,
    fractions: tuple[float, ...] = GUESS_FRACTIONS,
) -> dict[str, float]:
    """Empirical lower bound on ε at ``delta`` from canary scores (higher = more likely included).

    Valid with probability ``confidence`` for any (ε, δ)-DP mechanism, whatever the scores:
    each guess count is fixed in advance and the significance is split over them.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if scores.numel() != included.numel() or scores.numel() < 2:
        raise ValueError(
            f"need one score per canary and at least 2 canaries; got {scores.numel()} scores, {included.numel()} coins"
        )
    significance = (1 - confidence) / len(fractions)
    m = scores.numel()
    best = {"epsilon_lower": 0.0, "guesses": 0, "correct": 0}
    for r, v in audit_guesses(scores, included, fractions):
        eps = one_run_epsilon(m, r, v, delta, significance)
        if eps > best["epsilon_lower"] or best["guesses"] == 0:
            best = {"epsilon_lower": eps, "guesses": r, "correct": v}
    return {**best, "canaries": m, "confidence": confidence, "delta": delta}


def one_run_rejects_gdp(canaries: int, guesses: int, correct: int, mu: float, significance: float) -> bool:
    """Whether ``correct`` right out of ``guesses`` rejects "μ-GDP with respect to each canary" at
    ``significance``: the one-run f-DP audit of Mahloujifar, Melis & Chaudhuri 2024 (their
    recursive bound on the expected guesses a mechanism with trade-off f = G_μ allows)."""
    if guesses == 0 or correct == 0:
        return False

    def f_inverse(x: float) -> float:  # the inverse blow-up of G_μ: Φ(Φ⁻¹(x) − μ)
        return float(stats.norm.cdf(stats.norm.ppf(x) - mu)) if x < 1 else 1.0

    r = significance * correct / canaries
    h = significance * (guesses - correct) / canaries
    for i in range(correct - 1, -1, -1):
        h_next = max(h, f_inverse(r))
        if h_next == h:
            break
        r = min(r + i / (guesses - i) * (h_next - h), 1.0)
        h = h_next
    return r + h > guesses / canaries


def one_run_gdp_lower_bound(
    scores: Tensor,
    included: Tensor,
    delta: float,
    confidence: float = 0.95,
    fractions: tuple[float, ...] = GUESS_FRACTIONS,
) -> dict[str, float]:
    """Largest μ whose μ-GDP claim the canary guesses reject (one run, Mahloujifar et al. 2024), and
    the ε at ``delta`` of that μ. A Gaussian release (or a composition of them, without
    subsampling) is exactly μ-GDP for the μ the accountant composes, so this tests the proven
    claim itself, and is much tighter for Gaussian noise than the (ε, δ) bound."""
    from fedpers.privacy.accountant import analytic_gaussian_epsilon

    significance = (1 - confidence) / len(fractions)
    m = scores.numel()
    best = {"mu_lower": 0.0, "guesses": 0, "correct": 0}
    for r, v in audit_guesses(scores, included, fractions):
        if not one_run_rejects_gdp(m, r, v, 1e-9, significance):
            continue
        hi = 1.0
        while one_run_rejects_gdp(m, r, v, hi, significance) and hi < 64:
            hi *= 2
        mu = float(
            optimize.brentq(
                lambda x, r=r, v=v: 0.5 - one_run_rejects_gdp(m, r, v, x, significance), 1e-9, hi, xtol=1e-4
            )
        )
        if mu > best["mu_lower"]:
            best = {"mu_lower": mu, "guesses": r, "correct": v}
    eps = analytic_gaussian_epsilon(best["mu_lower"], delta) if best["mu_lower"] > 0 else 0.0
    return {**best, "epsilon_lower": eps, "canaries": m, "confidence": confidence, "delta": delta}


def independent_gdp_lower_bound(
    scores: Tensor, included: Tensor, confidence: float = 0.95, threshold: float = 0.0
) -> float:
    """Lower bound on μ from canaries taken as independent trials: guess "included" when the score
    is above ``threshold`` (fixed in advance), one-sided Clopper–Pearson bounds on TPR and FPR,
    each at confidence 1 − (1 − ``confidence``)/2, and μ ≥ Φ⁻¹(TPR_lo) − Φ⁻¹(FPR_hi).

    Exact for canaries in independent runs; within one run it holds when the releases are the
    Gaussian mechanisms the ledger says they are and the canaries' directions are orthogonal
    (then their scores are independent), which is the claim under test.
    """
    truth = included.bool().flatten()
    guess = scores.double().flatten() > threshold
    n_in, n_out = int(truth.sum()), int((~truth).sum())
    if n_in == 0 or n_out == 0:
        return 0.0
    per_side = 1 - (1 - confidence) / 2
    tpr_lo, _ = clopper_pearson(int((guess & truth).sum()), n_in, per_side)
    _, fpr_hi = clopper_pearson(int((guess & ~truth).sum()), n_out, per_side)
    if tpr_lo <= 0 or fpr_hi >= 1:
        return 0.0
    return max(0.0, float(stats.norm.ppf(tpr_lo) - stats.norm.ppf(fpr_hi)))


GAUSSIAN_SCORE_ASSUMPTION = (
    "the scores of included and left-out canaries are Gaussian with one variance (the score test's "
    "trade-off is then G_μ); not valid for every mechanism"
)


def gaussian_score_mu(scores: Tensor, included: Tensor, confidence: float = 0.95) -> dict[str, float]:
    """μ of the trade-off curve G_μ from the two score distributions, assuming both are Gaussian with
    one variance: Hedges' g (the standardised mean difference, corrected for its small-sample bias)
    and a one-sided lower / upper bound at ``confidence`` each, exact under the assumption by
    inverting the noncentral t law of the two-sample t statistic.

    Under the assumption the test "score > threshold" has trade-off G_μ, so a mechanism that is
    μ′-GDP has μ′ ≥ μ; ``mu_lower`` > the proven μ then contradicts the proof (at ``confidence``)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    s = scores.double().flatten().numpy()
    truth = included.bool().flatten().numpy()
    a, b = s[truth], s[~truth]
    n1, n0 = a.size, b.size
    if n1 < 2 or n0 < 2:
        raise ValueError(f"need at least 2 included and 2 left-out canaries; got {n1} and {n0}")
    df = n1 + n0 - 2
    pooled = float(np.sqrt(((n1 - 1) * a.var(ddof=1) + (n0 - 1) * b.var(ddof=1)) / df))
    if pooled == 0:
        return {"mu": 0.0, "mu_lower": 0.0, "mu_upper": 0.0, "confidence": confidence, "n_in": n1, "n_out": n0}
    d = float((a.mean() - b.mean()) / pooled)
    scale = float(np.sqrt(n1 * n0 / (n1 + n0)))  # t = d·scale ~ nct(df, μ·scale)
    t = d * scale
    correction = 1.0 - 3.0 / (4.0 * df - 1.0)  # Hedges' J: E[J·d] = μ
    alpha = 1.0 - confidence

    def noncentrality(tail: float) -> float:
        """nc with P[T ≥ t | nc] = tail (increasing in nc)."""
        lo, hi = t - 10.0 - abs(t), t + 10.0 + abs(t)
        return float(optimize.brentq(lambda nc: float(stats.nct.sf(t, df, nc)) - tail, lo, hi, xtol=1e-10))

    return {
        "mu": correction * d,
        "mu_lower": noncentrality(alpha) / scale,
        "mu_upper": noncentrality(1.0 - alpha) / scale,
        "confidence": confidence,
        "n_in": n1,
        "n_out": n0,
    }
