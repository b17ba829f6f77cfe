"""DP attention's config (``fedpers run dpattention``, docs/algorithms.md §4): its fields and ranges, and
Theorem 3.1's public parameters and the preconditions they alone decide.

Every precondition of the theorem that the declared values decide (ε, δ and r below 0.1, d ≥ n,
0 < η < r, 2αβ√n/η < Δ, ρ < 0.1ε) is checked here, so a run that could not claim DP is refused
before any work; the two that depend on the data (XXᵀ ⪰ ηI, max|A_ij| ≤ r) are decided on the summed
A before the release (:meth:`fedpers.privacy.Privatizer.dp_covariance`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from fedpers.config import DEFAULT_DELTA, ApproxDpRunConfig, DeviceRunConfig, Neighbours, field, inherited, run_config
from fedpers.configs.shared import BASELINES_HELP, parse_baselines


class AttentionFn(str, enum.Enum):
    EXP = "exp"
    COSH = "cosh"


BASELINES = ("uniform_attention",)
"""DP attention's baseline: the uniform attention matrix, every entry 1/n."""

THEOREM_LIMIT = 0.1
"""Theorem 3.1 proves its (ε, δ) only for ε, δ and r in (0, 0.1)."""


@run_config
class DpAttentionConfig(ApproxDpRunConfig):
    rows: int = field(4, "n: rows of X (the attention matrix is n×n)", ge=1)
    columns: int = field(10000, "d: columns of X (the privacy units, d ≫ n)", ge=1)
    k: int = field(0, "Gaussian samples in DPCovariance (0: the smallest k with ρ < 0.1ε)", ge=0)
    epsilon: float = field(0.09, "ε of the (ε, δ) guarantee (Theorem 3.1 needs ε < 0.1)", gt=0.0)
    delta: float = field(DEFAULT_DELTA, "δ (Theorem 3.1 needs δ < 0.1)", gt=0.0, lt=1.0)
    beta: float = field(1e-6, "β: neighbouring X differ in one column, moved by at most β", gt=0.0)
    f: AttentionFn = field(AttentionFn.EXP, "entrywise function of the attention: exp or cosh")
    r: float = field(0.05, "promise ||A||_∞ = max|A_ij| ≤ r (Theorem 3.1 needs r < 0.1)", gt=0.0)
    alpha: float = field(
        0.0, "α: column-norm bound, each column clipped to it (0: the synthetic columns' norm sqrt(s·n/d))", ge=0.0
    )
    eta: float = field(
        0.0, "promise XXᵀ ⪰ ηI (0: half the synthetic data's expected λ_min, s(1 − sqrt(n/d))²/2)", ge=0.0
    )
    data_scale: float = field(0.025, "s: the synthetic columns are uniform on a sphere with E[XXᵀ] = s·I", gt=0.0)
    gamma: float = field(0.1, "γ: the utility bound holds with probability 1 − γ", gt=0.0, lt=1.0)
    baselines: str = field("all", BASELINES_HELP + "uniform_attention (every row 1/n)")
    seed: int = inherited()
    neighbours: Neighbours = inherited()
    dtype: str = inherited(DeviceRunConfig)
    chunk_size: int = field(65536, "columns per batch on the local runtime", ge=1)

    def check(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64; got {self.dtype!r}")
        parse_baselines(self.baselines, BASELINES)
        if self.neighbours is not Neighbours.REPLACE_ONE:
            raise ValueError(
                f"neighbours must be replace-one for dpattention (DPCovariance's (ε, δ) is stated for one column "
                f"moved by at most β, not for adding or removing a column); got {self.neighbours.value}"
            )
        failed = [c for c in public_conditions(theorem_params(self)) if not c.holds]
        if failed:
            raise ValueError(
                "dpattention: Theorem 3.1 would not hold for these values, so nothing is run: "
                + "; ".join(f"{c.fix} ({c.text}; here {c.value:.4g} vs {c.bound:.4g})" for c in failed)
            )


@dataclass(frozen=True)
class DpCovarianceParams:
    """Public parameters of DPCovariance (Theorem 3.1 of the DP-attention paper).

    ``alpha``, ``eta`` and ``r`` are promises about the data domain (column norms ≤ α,
    XXᵀ ⪰ ηI, max|A_ij| ≤ r); ``beta`` defines neighbours (one column moves by ≤ β);
    ``gamma`` is the failure probability of the utility guarantee.
    """

    rows: int
    columns: int
    k: int
    epsilon: float
    delta: float
    alpha: float
    beta: float
    eta: float
    r: float
    gamma: float

    @property
    def Delta(self) -> float:
        """Δ = 0.1·min(ε/sqrt(k log(1/δ)), ε/log(1/δ)) (docs/algorithms.md §4)."""
        log_term = math.log(1.0 / self.delta)
        return 0.1 * min(self.epsilon / math.sqrt(self.k * log_term), self.epsilon / log_term)

    @property
    def rho(self) -> float:
        """ρ = sqrt((n² + log(1/γ))/k) + (n² + log(1/γ))/k: B is within (1 ± ρ)A w.p. 1 − γ."""
        return dp_covariance_rho(self.rows, self.k, self.gamma)

    @property
    def sensitivity(self) -> float:
        """2αβ√n/η: bound on ||A^{1/2} Ã^{-1} A^{1/2} − I||_F for β-close neighbours (Lemma 4.11)."""
        return 2 * self.alpha * self.beta * math.sqrt(self.rows) / self.eta if self.eta > 0 else math.inf

    @property
    def utility_bound(self) -> float:
        """4(1 + ε + 2r)r: the paper's bound on ||D(A)⁻¹f(A) − D(B)⁻¹f(B)||_∞."""
        return 4 * (1 + self.epsilon + 2 * self.r) * self.r


def dp_covariance_rho(rows: int, k: int, gamma: float) -> float:
    q = (rows**2 + math.log(1.0 / gamma)) / k
    return math.sqrt(q) + q


def dp_covariance_min_k(rows: int, epsilon: float, gamma: float) -> int:
    """The smallest k with ρ < 0.1ε (sqrt(q) + q < 0.1ε ⇔ sqrt(q) < (−1 + sqrt(1 + 0.4ε))/2)."""
    t = (-1 + math.sqrt(1 + 0.4 * epsilon)) / 2
    if not t**2 > 0:  # 1 + 0.4ε rounds to 1 (ε below ~1e-15): no k reaches ρ < 0.1ε in floating point
        raise ValueError(f"epsilon {epsilon:g} is too small for DPCovariance's default k (ρ < 0.1ε); raise --epsilon")
    k = max(1, math.floor((rows**2 + math.log(1 / gamma)) / t**2) + 1)
    while dp_covariance_rho(rows, k, gamma) >= 0.1 * epsilon:
        k += 1
    return k


@dataclass(frozen=True)
class Condition:
    """One precondition of a mechanism's stated guarantee, with the numbers it was decided on and,
    for one the declared values decide, the flag and range that make it hold (``fix``)."""

    name: str
    holds: bool
    value: float
    bound: float
    text: str
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"holds": self.holds, "value": self.value, "bound": self.bound, "text": self.text}


def data_norm(cfg: DpAttentionConfig) -> float:
    """The synthetic columns' norm: E[XXᵀ] = d·norm²/n·I = s·I."""
    return math.sqrt(cfg.data_scale * cfg.rows / cfg.columns)


def theorem_params(cfg: DpAttentionConfig) -> DpCovarianceParams:
    """The theorem's parameters of ``cfg``: α, η and k where the config leaves them to their defaults."""
    alpha = cfg.alpha if cfg.alpha > 0 else data_norm(cfg)
    eta = cfg.eta if cfg.eta > 0 else cfg.data_scale * max(0.0, 1 - math.sqrt(cfg.rows / cfg.columns)) ** 2 / 2
    if eta <= 0:
        raise ValueError(f"eta: the default needs columns > rows (got d={cfg.columns}, n={cfg.rows}); set --eta")
    k = cfg.k if cfg.k > 0 else dp_covariance_min_k(cfg.rows, cfg.epsilon, cfg.gamma)
    return DpCovarianceParams(
        rows=cfg.rows,
        columns=cfg.columns,
        k=k,
        epsilon=cfg.epsilon,
        delta=cfg.delta,
        alpha=alpha,
        beta=cfg.beta,
        eta=eta,
        r=cfg.r,
        gamma=cfg.gamma,
    )


def public_conditions(p: DpCovarianceParams) -> tuple[Condition, ...]:
    """The preconditions of Theorem 3.1 that the public parameters alone decide (column norms ≤ α
    holds by construction: every client clips its columns to α)."""
    limit = THEOREM_LIMIT
    beta_max = p.Delta * p.eta / (2 * p.alpha * math.sqrt(p.rows)) if p.alpha > 0 else math.inf
    k_min = dp_covariance_min_k(p.rows, p.epsilon, p.gamma) if 0 < p.epsilon else 0
    return (
        Condition(
            "epsilon_range", 0 < p.epsilon < limit, p.epsilon, limit, "ε ∈ (0, 0.1)", "epsilon must be in (0, 0.1)"
        ),
        Condition("delta_range", 0 < p.delta < limit, p.delta, limit, "δ ∈ (0, 0.1)", "delta must be in (0, 0.1)"),
        Condition("r_range", 0 < p.r < limit, p.r, limit, "r ∈ (0, 0.1)", "r must be in (0, 0.1)"),
        Condition("d_ge_n", p.columns >= p.rows, p.columns, p.rows, "d ≥ n", "columns must be >= rows"),
        Condition("eta_lt_r", 0 < p.eta < p.r, p.eta, p.r, "0 < η < r", f"eta must be in (0, r = {p.r:g})"),
        Condition(
            "column_norms", p.alpha > 0, p.alpha, p.alpha, "column norms ≤ α (each column clipped to α by its client)"
        ),
        Condition(
            "beta_bound",
            p.sensitivity < p.Delta,
            p.sensitivity,
            p.Delta,
            "2αβ√n/η < Δ = 0.1·min(ε/sqrt(k log(1/δ)), ε/log(1/δ))",
            f"beta must be < Δη/(2α√n) = {beta_max:.4g}",
        ),
        Condition(
            "rho_bound",
            p.rho < 0.1 * p.epsilon,
            p.rho,
            0.1 * p.epsilon,
            "ρ = sqrt((n² + log(1/γ))/k) + (n² + log(1/γ))/k < 0.1ε",
            f"k must be >= {k_min} (0: the smallest)",
        ),
    )
