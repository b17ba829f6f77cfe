"""Correlated (matrix-factorization) noise for a stream of per-round Gaussian sums.

The workload is the prefix sums of the rounds' clipped sums x_1..x_T (A = lower-triangular
ones: a constant step size only scales it). A factorization A = B·C with C lower-triangular
releases B(Cx + z) = Ax + Bz; equivalently round t releases x_t + w_t with w = C⁻¹z, z
Gaussian. C here is a banded Toeplitz matrix (c_0 = 1, c_1..c_{b−1}, then 0), so w solves
C w = z by forward substitution, keeping the b − 1 last noise vectors and never the history
(:class:`NoiseRecurrence`).

The whole stream is one Gaussian mechanism on Cx: a user who contributes g_t (‖g_t‖ ≤ the
clip) in the rounds of its participation set S moves Cx by ‖Σ_{t∈S} C[:, t] g_tᵀ‖. Its
maximum over users and directions, per unit clip, is :func:`sensitivity` (replace-one Δ is
twice the clip times it). Lower-triangular C makes the adaptive stream as private as the
non-adaptive one (Denisov et al., "Improved Differential Privacy for SGD via Optimal Private
Linear Operators on Adaptive Streams", NeurIPS 2022, Theorem 2.1).

Strategies (docs/algorithms.md, "Correlated noise"):

- ``independent``: C = I (one band), today's mechanism;
- ``banded``: the square root of the prefix-sum matrix, c_k = binom(2k, k)/4ᵏ, truncated to
  b bands (Kalinin and Lampert, "Banded Square Root Matrix Factorization for Differentially
  Private Model Training", 2024);
- ``optimised``: the b coefficients minimising the total squared error of the prefix sums
  times the squared sensitivity for the run's horizon and cycle (BandMF of Choquette-Choo et
  al., "(Amplified) Banded Matrix Factorization", NeurIPS 2023, here restricted to Toeplitz
  C with non-negative coefficients and solved with torch's L-BFGS).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor

NOISE_KINDS = ("independent", "banded", "optimised")


@dataclass(frozen=True)
class SensitivityResult:
    """Sensitivity per unit clip (max over users of the norm they move Cx by) and the rule used."""

    value: float
    rule: str
    participations: int


@dataclass(frozen=True)
class Strategy:
    """Public description of C: banded lower-triangular Toeplitz with ``coefficients`` (c_0 = 1)."""

    kind: str
    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}; got {self.kind!r}")
        if not self.coefficients or self.coefficients[0] != 1.0:
            raise ValueError(f"a strategy's first coefficient must be 1; got {self.coefficients[:1]}")
        if not all(math.isfinite(c) for c in self.coefficients):
            raise ValueError("a strategy's coefficients must be finite")

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    def matrix(self, horizon: int) -> Tensor:
        """C as a dense (T, T) float64 matrix."""
        return toeplitz(torch.tensor(self.coefficients, dtype=torch.float64), horizon)

    def digest(self) -> str:
        """SHA-256 of the coefficients' float64 bytes (recorded per release)."""
        return hashlib.sha256(torch.tensor(self.coefficients, dtype=torch.float64).numpy().tobytes()).hexdigest()


def toeplitz(coefficients: Tensor, horizon: int) -> Tensor:
    """Lower-triangular Toeplitz (T, T) matrix with first column ``coefficients`` (zero-padded or cut)."""
    c = torch.zeros(horizon, dtype=coefficients.dtype)
    b = min(horizon, coefficients.shape[0])
    c = torch.cat([coefficients[:b], c[b:]])
    i = torch.arange(horizon)
    lag = i[:, None] - i[None, :]
    return torch.where(lag >= 0, c[lag.clamp_min(0)], torch.zeros((), dtype=c.dtype))


def sqrt_coefficients(bands: int) -> tuple[float, ...]:
    """binom(2k, k)/4ᵏ for k < ``bands``: the square root of the prefix-sum matrix, truncated."""
    if bands < 1:
        raise ValueError(f"bands must be >= 1; got {bands}")
    out = [1.0]
    for k in range(1, bands):
        out.append(out[-1] * (2 * k - 1) / (2 * k))
    return tuple(out)


def cyclic_participation(horizon: int, cycle: int) -> Tensor:
    """(K, T) 0/1 matrix: cohort k takes part in the rounds t (0-based) with t mod K = k."""
    if not 1 <= cycle:
        raise ValueError(f"cycle must be >= 1; got {cycle}")
    t = torch.arange(horizon)
    return (t[None, :] % cycle == torch.arange(min(cycle, horizon))[:, None]).to(torch.float64)


def max_participations(patterns: Tensor) -> int:
    return int(patterns.sum(1).max())


def sensitivity(C: Tensor, patterns: Tensor) -> SensitivityResult:
    """max over participation patterns p (rows of ``patterns``) and per-round contributions g_t of
    norm ≤ 1 of ‖Σ_{t: p_t = 1} C[:, t] g_tᵀ‖_F.

    With X = CᵀC restricted to a pattern's rounds S, the squared norm is Σ_{s,t∈S} X_st⟨g_s, g_t⟩.
    - every X_st (s ≠ t in S) zero (the columns a user touches are orthogonal, e.g. b ≤ K bands
      under a K-cycle): Σ_{t∈S} ‖C[:, t]‖², exact;
    - every X_st ≥ 0 (e.g. C ≥ 0): the maximum is at g_t all equal, ‖C p‖², exact;
    - otherwise Σ_{s,t∈S} |X_st|, an upper bound (the absolute-value rule of Choquette-Choo et al.
      2023, Eq. (5)), recorded as such.
    """
    X = C.transpose(0, 1) @ C
    best, rule = 0.0, "orthogonal columns"
    tol = 1e-12 * float(X.diagonal().abs().max().clamp_min(1e-300))
    for p in patterns:
        S = p.nonzero().squeeze(1)
        block = X[S][:, S]
        off = block - torch.diag(block.diagonal())
        if bool((off.abs() <= tol).all()):
            value, this = float(block.diagonal().sum()), "orthogonal columns"
        elif bool((off >= -tol).all()):
            value, this = float(block.sum()), "non-negative Gram"
        else:
            value, this = float(block.abs().sum()), "absolute Gram bound (upper bound)"
        if _rank(this) > _rank(rule):
            rule = this
        best = max(best, value)
    return SensitivityResult(math.sqrt(best), rule, max_participations(patterns))


def _rank(rule: str) -> int:
    return ("orthogonal columns", "non-negative Gram", "absolute Gram bound (upper bound)").index(rule)


def prefix_error(coefficients: Tensor, horizon: int) -> Tensor:
    """‖A C⁻¹‖_F²: total squared error of the T prefix sums per unit noise (A = prefix sums)."""
    e1 = torch.zeros(horizon, 1, dtype=coefficients.dtype)
    e1[0, 0] = 1.0
    r = torch.linalg.solve_triangular(toeplitz(coefficients, horizon), e1, upper=False).squeeze(1)
    beta = torch.cumsum(r, 0)  # A C⁻¹ is Toeplitz with first column cumsum(C⁻¹ e_1)
    weights = torch.arange(horizon, 0, -1, dtype=coefficients.dtype)
    return (weights * beta**2).sum()


def loss(coefficients: Tensor, horizon: int, patterns: Tensor) -> Tensor:
    """Squared sensitivity (non-negative C: max ‖C p‖²) × total squared prefix-sum error."""
    C = toeplitz(coefficients, horizon)
    sens2 = ((C @ patterns.transpose(0, 1)) ** 2).sum(0).max()
    return sens2 * prefix_error(coefficients, horizon)


def optimised_coefficients(horizon: int, bands: int, cycle: int, iterations: int = 200) -> tuple[float, ...]:
    """Non-negative banded Toeplitz coefficients (c_0 = 1) minimising :func:`loss` for the
    horizon and the K-cycle's participation, from the square-root coefficients (L-BFGS on
    log c_1..log c_{b−1}); never worse than the start it is given."""
    start = torch.tensor(sqrt_coefficients(bands), dtype=torch.float64)
    bands = min(bands, horizon)
    start = start[:bands]
    if bands == 1:
        return (1.0,)
    patterns = cyclic_participation(horizon, cycle)
    theta = start[1:].log().clone().requires_grad_(True)
    one = torch.ones(1, dtype=torch.float64)

    def coefs() -> Tensor:
        return torch.cat([one, theta.exp()])

    opt = torch.optim.LBFGS([theta], lr=0.5, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        value = torch.log(loss(coefs(), horizon, patterns))
        value.backward()
        return value

    opt.step(closure)
    with torch.no_grad():
        found = coefs()
        if not bool(torch.isfinite(found).all()) or float(loss(found, horizon, patterns)) > float(
            loss(start, horizon, patterns)
        ):
            found = start
    return tuple(float(c) for c in found)


def strategy(kind: str, horizon: int, bands: int, cycle: int) -> Strategy:
    """The public strategy a run uses (computed from its configuration alone)."""
    if kind == "independent":
        return Strategy(kind, (1.0,))
    if not 1 <= bands <= horizon:
        raise ValueError(f"bands must be in [1, rounds={horizon}]; got {bands}")
    if kind == "banded":
        return Strategy(kind, sqrt_coefficients(bands))
    if kind == "optimised":
        return Strategy(kind, optimised_coefficients(horizon, bands, cycle))
    raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}; got {kind!r}")


@dataclass(frozen=True)
class CorrelatedNoise:
    """A run's correlated mechanism: the strategy, its horizon T and the participation's sensitivity.

    Accounting: the T rounds are one Gaussian mechanism on Cx with Δ = 2·clip·s (s =
    ``sensitivity.value``). With P = max participations and the run's per-participation
    multiplier z (calibrated exactly as P independent releases would be), the noise std is
    σ = z·clip·s/√P, so the joint multiplier is z/√P: the same guarantee as P Gaussians of z.
    """

    strategy: Strategy
    horizon: int
    sensitivity: SensitivityResult
    cycle: int

    def noise_std(self, noise_multiplier: float, clip: float) -> float:
        s, p = self.sensitivity.value, self.sensitivity.participations
        return noise_multiplier * clip * (s / math.sqrt(p)) if noise_multiplier > 0 else 0.0

    def params(self) -> dict[str, object]:
        return {
            "noise": self.strategy.kind,
            "bands": self.strategy.bands,
            "strategy_digest": self.strategy.digest(),
            "horizon": self.horizon,
            "cycle": self.cycle,
            "unit_sensitivity": self.sensitivity.value,
            "sensitivity_rule": self.sensitivity.rule,
            "participations": self.sensitivity.participations,
        }


def mechanism(kind: str, horizon: int, bands: int, cycle: int) -> CorrelatedNoise:
    """The strategy for (kind, horizon, bands, cycle) and its sensitivity under the K-cycle."""
    s = strategy(kind, horizon, bands, cycle)
    patterns = cyclic_participation(horizon, cycle)
    return CorrelatedNoise(s, horizon, sensitivity(s.matrix(horizon), patterns), cycle)


@dataclass
class NoiseRecurrence:
    """w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0: round t's slice of C⁻¹z, keeping b − 1 vectors."""

    coefficients: tuple[float, ...]
    step: int = 0
    history: list[Tensor] = field(default_factory=list)
    """The last b − 1 noise vectors w, most recent first (float64)."""

    def next(self, z: Tensor) -> Tensor:
        w = z.clone()
        for c, past in zip(self.coefficients[1:], self.history, strict=False):
            w = w - c * past
        w = w / self.coefficients[0]
        self.history = [w, *self.history][: len(self.coefficients) - 1]
        self.step += 1
        return w


def cycle_of(cohorts: str, cycle: int) -> int:
    """K of a run: --cycle with cohorts cyclic, else 1 (every user, or Poisson, every round)."""
    return cycle if cohorts == "cyclic" else 1


def check_settings(cohorts: str, cycle: int, noise: str, bands: int, rounds: int, units: int) -> None:
    """Refuse (before any release) a cycle or noise setting the run cannot account."""
    if cohorts != "cyclic" and cycle != 1:
        raise ValueError(f"cycle needs cohorts cyclic; got cycle {cycle} with cohorts {cohorts}")
    if cohorts == "cyclic" and not 1 <= cycle <= units:
        raise ValueError(f"cycle must be in [1, {units}] (the number of units); got {cycle}")
    if noise not in NOISE_KINDS:
        raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}; got {noise!r}")
    if noise != "independent" and cohorts == "poisson":
        raise ValueError(
            "noise: correlated noise with cohorts poisson needs the amplified banded analysis, which fedpers "
            "does not implement; use cohorts cyclic (or all) with correlated noise, or noise independent"
        )
    if noise == "independent" and bands not in (0, 1):
        raise ValueError(f"bands needs noise banded or optimised; got bands {bands} with noise independent")
    if bands > rounds:
        raise ValueError(f"bands must be in [0, rounds={rounds}]; got {bands}")


def run_mechanism(noise: str, rounds: int, bands: int, cycle: int) -> CorrelatedNoise:
    """The public strategy and its sensitivity under the run's cycle (bands 0: b = min(K, T))."""
    return mechanism(noise, rounds, bands or min(cycle, rounds), cycle)
