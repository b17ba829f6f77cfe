"""Correlated (matrix-factorization) noise for a stream of per-round Gaussian sums.

The workload is the prefix sums of the rounds' clipped sums x_1..x_T (A = lower-triangular
ones: a constant step size only scales it), or with a declared decay λ < 1 the iterates of
x_t = λ·x_{t−1} + g_t (A_λ, entries λ^(t−s)): a protocol that forgets a perturbation by λ per
round (FedRep's re-fitted, re-orthonormalised U does) pays for noise in its last few rounds
only, and a strategy chosen for prefix sums spends its budget on error it never sees. A factorization A = B·C with C lower-triangular
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
- ``banded``: the square root of the workload matrix, c_k = binom(2k, k)/4ᵏ·λᵏ, truncated to
  b bands (Kalinin and Lampert, "Banded Square Root Matrix Factorization for Differentially
  Private Model Training", 2024);
- ``optimised``: the b coefficients minimising the total squared error of the workload
  times the squared sensitivity for the run's horizon and cycle (BandMF of Choquette-Choo et
  al., "(Amplified) Banded Matrix Factorization", NeurIPS 2023, here restricted to Toeplitz
  C with non-negative coefficients and solved with torch's L-BFGS);
- ``blt``: a buffered linear Toeplitz C optimised for the same loss (McMahan et al., "Efficient
  and Near-Optimal Noise Generation for Streaming Differential Privacy", 2024; jax_privacy's
  ``BufferedToeplitz``), its noise generated from one buffer per decay.

Both optimisers also compare with independent noise (feasible for both) and never return worse.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from fedpers import linalg
from fedpers.configs.gradient_rounds import NOISE_KINDS

Tensor = torch.Tensor


@dataclass(frozen=True)
class SensitivityResult:
    """Sensitivity per unit clip (max over users of the norm they move Cx by), the rule used and
    the participation schedules it holds for (``scope``)."""

    value: float
    rule: str
    participations: int
    scope: str = ""


@dataclass(frozen=True)
class Strategy:
    """Public description of C: lower-triangular Toeplitz with c_0 = 1, either banded with
    ``coefficients`` (c_0..c_{b−1}, then 0) or, for ``blt``, buffered linear Toeplitz with
    c_k = Σ_i ω_i θ_i^(k−1) for k ≥ 1 (θ = ``buf_decay``, ω = ``output_scale``; ``coefficients`` = (1,))."""

    kind: str
    coefficients: tuple[float, ...]
    buf_decay: tuple[float, ...] = ()
    output_scale: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in NOISE_KINDS:
            raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}; got {self.kind!r}")
        if not self.coefficients or self.coefficients[0] != 1.0:
            raise ValueError(f"a strategy's first coefficient must be 1; got {self.coefficients[:1]}")
        if not all(math.isfinite(c) for c in (*self.coefficients, *self.buf_decay, *self.output_scale)):
            raise ValueError("a strategy's coefficients must be finite")
        if len(self.buf_decay) != len(self.output_scale) or (self.kind == "blt") != bool(self.buf_decay):
            raise ValueError("buf_decay and output_scale: one pair per buffer, for noise blt only")
        if self.buf_decay and (len(self.coefficients) != 1 or not all(0.0 <= d < 1.0 for d in self.buf_decay)):
            raise ValueError(f"a BLT's buf_decay must be in [0, 1) and its coefficients (1,); got {self.buf_decay}")

    @property
    def bands(self) -> int:
        """b for a banded C; 0 for a BLT (every coefficient may be non-zero)."""
        return 0 if self.buf_decay else len(self.coefficients)

    @property
    def buffers(self) -> int:
        return len(self.buf_decay)

    def toeplitz_coefficients(self, horizon: int) -> Tensor:
        """c_0..c_{T−1} (float64)."""
        if not self.buf_decay:
            return torch.tensor(self.coefficients, dtype=torch.float64)[:horizon]
        return blt_coefficients(
            torch.tensor(self.buf_decay, dtype=torch.float64),
            torch.tensor(self.output_scale, dtype=torch.float64),
            horizon,
        )

    def matrix(self, horizon: int) -> Tensor:
        """C as a dense (T, T) float64 matrix."""
        return toeplitz(self.toeplitz_coefficients(horizon), horizon)

    def recurrence(self) -> NoiseRecurrence:
        """A fresh generator of C⁻¹z's rows for this strategy."""
        return NoiseRecurrence(self.coefficients, buf_decay=self.buf_decay, output_scale=self.output_scale)

    def digest(self) -> str:
        """SHA-256 of the coefficients' (and a BLT's θ, ω) float64 bytes (recorded per release)."""
        values = (*self.coefficients, *self.buf_decay, *self.output_scale)
        return hashlib.sha256(torch.tensor(values, dtype=torch.float64).numpy().tobytes()).hexdigest()


def blt_coefficients(buf_decay: Tensor, output_scale: Tensor, horizon: int) -> Tensor:
    """Toeplitz coefficients of a BLT: c_0 = 1, c_k = Σ_i ω_i θ_i^(k−1) (jax_privacy's
    ``BufferedToeplitz.toeplitz_coefs``; McMahan et al., "Efficient and Near-Optimal Noise
    Generation for Streaming Differential Privacy", 2024)."""
    powers = torch.arange(max(horizon - 1, 0), dtype=buf_decay.dtype)
    rest = (buf_decay[None, :] ** powers[:, None] * output_scale[None, :]).sum(1)
    return torch.cat([torch.ones(1, dtype=buf_decay.dtype), rest])[:horizon]


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


def decay_workload(horizon: int, decay: float = 1.0, dtype: torch.dtype = torch.float64) -> Tensor:
    """A_λ: lower-triangular Toeplitz with entries λ^(t−s), the iterates of x_t = λ·x_{t−1} + g_t
    (λ = 1: prefix sums). A protocol whose iterate forgets a perturbation by a factor λ per round
    (a declared contraction, public like the step size) has this workload."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"noise_decay must be in (0, 1]; got {decay}")
    return toeplitz(decay ** torch.arange(horizon, dtype=dtype), horizon)


def prefix_error(coefficients: Tensor, horizon: int, decay: float = 1.0) -> Tensor:
    """‖A_λ C⁻¹‖_F²: total squared error of the T iterates per unit noise (λ = 1: prefix sums)."""
    e1 = torch.zeros(horizon, 1, dtype=coefficients.dtype)
    e1[0, 0] = 1.0
    r = torch.linalg.solve_triangular(toeplitz(coefficients, horizon), e1, upper=False).squeeze(1)
    if decay == 1.0:
        beta = torch.cumsum(r, 0)  # A C⁻¹ is Toeplitz with first column cumsum(C⁻¹ e_1)
    else:
        beta = decay_workload(horizon, decay, coefficients.dtype) @ r  # A_λ C⁻¹'s first column
    weights = torch.arange(horizon, 0, -1, dtype=coefficients.dtype)
    return (weights * beta**2).sum()


def loss(coefficients: Tensor, horizon: int, patterns: Tensor, decay: float = 1.0) -> Tensor:
    """Squared sensitivity (non-negative C: max ‖C p‖²) × total squared error of the A_λ workload."""
    C = toeplitz(coefficients, horizon)
    sens2 = ((C @ patterns.transpose(0, 1)) ** 2).sum(0).max()
    return sens2 * prefix_error(coefficients, horizon, decay)


def sqrt_decay_coefficients(bands: int, decay: float = 1.0) -> tuple[float, ...]:
    """binom(2k, k)/4ᵏ·λᵏ: the square root of A_λ (Toeplitz λ^k), truncated to ``bands``."""
    return tuple(c * decay**k for k, c in enumerate(sqrt_coefficients(bands)))


def optimised_coefficients(
    horizon: int,
    bands: int,
    cycle: int,
    iterations: int = 200,
    decay: float = 1.0,
    patterns: Tensor | None = None,
) -> tuple[float, ...]:
    """Non-negative banded Toeplitz coefficients (c_0 = 1) minimising :func:`loss` for the
    horizon, the K-cycle's participation (or the given ``patterns``: one participation for the
    amplified analysis, :func:`single_participation`) and the A_λ workload, from the square root
    of A_λ (L-BFGS on log c_1..log c_{b−1}). The result is the best of what L-BFGS found, its start
    and independent noise (c = (1, 0, …, 0), always feasible): never worse than either on the loss."""
    bands = min(bands, horizon)
    if bands == 1:
        return (1.0,)
    start = torch.tensor(sqrt_decay_coefficients(bands, decay), dtype=torch.float64)
    patterns = cyclic_participation(horizon, cycle) if patterns is None else patterns
    theta = start[1:].log().clone().requires_grad_(True)
    one = torch.ones(1, dtype=torch.float64)

    def coefs() -> Tensor:
        return torch.cat([one, theta.exp()])

    opt = torch.optim.LBFGS([theta], lr=0.5, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        value = torch.log(loss(coefs(), horizon, patterns, decay))
        value.backward()
        return value

    opt.step(closure)
    with torch.no_grad():
        identity = torch.cat([one, torch.zeros(bands - 1, dtype=torch.float64)])
        candidates = [_public(c) for c in (coefs(), start) if bool(torch.isfinite(c).all())] + [identity]
        found = min(candidates, key=lambda c: float(loss(c, horizon, patterns, decay)))
    return tuple(float(c) for c in found)


def _public(values: Tensor, one_minus: bool = False) -> Tensor:
    """``values`` rounded to 6 significant digits (of 1 − value with ``one_minus``): the optimisers'
    last bits vary with the threads a process happens to use, and a strategy must be the same
    wherever the configuration is read (server, ledger recomputation, resumed run)."""
    x = 1.0 - values if one_minus else values
    rounded = torch.tensor([float(f"{float(v):.6g}") for v in x], dtype=torch.float64)
    return 1.0 - rounded if one_minus else rounded


BLT_BUFFERS = 4
"""The most buffers a BLT gets when --bands is 0 (jax_privacy's optimiser uses a handful; more add
little); :func:`chosen_blt` takes the fewest whose loss is within :data:`BLT_TOLERANCE` of the best."""
BLT_TOLERANCE = 1e-6
"""Relative loss a BLT buffer may add and still be dropped: a buffer is noise state per coordinate."""


def optimised_blt(
    horizon: int, buffers: int, cycle: int, iterations: int = 200, decay: float = 1.0
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(θ, ω) of a BLT with θ ∈ (0, 1), ω > 0 (so C ≥ 0 and the non-negative-Gram sensitivity is
    exact) minimising :func:`loss` for the horizon, the K-cycle and the A_λ workload (L-BFGS on
    logit θ, log ω, as jax_privacy's ``buffered_toeplitz.optimize`` for our loss). The start fits
    ω to the square root of A_λ at geometrically spaced θ; the result is the best of what L-BFGS
    found, its start and independent noise (ω = 0)."""
    if buffers < 1:
        raise ValueError(f"bands (a BLT's buffers) must be >= 1; got {buffers}")
    theta0 = 1.0 - 0.5 ** (2.0 * torch.arange(1, buffers + 1, dtype=torch.float64) - 1.0)
    if horizon == 1:  # C = (1) whatever θ, ω: independent noise
        return tuple(float(t) for t in theta0.flip(0)), (0.0,) * buffers
    patterns = cyclic_participation(horizon, cycle)
    theta0 = 1.0 - 0.5 ** (2.0 * torch.arange(1, buffers + 1, dtype=torch.float64) - 1.0)
    target = torch.tensor(sqrt_decay_coefficients(horizon, decay), dtype=torch.float64)[1:]
    basis = theta0[None, :] ** torch.arange(horizon - 1, dtype=torch.float64)[:, None]
    omega0 = linalg.lstsq(basis, target[:, None]).squeeze(1).clamp_min(1e-6)
    a = torch.logit(theta0).clone().requires_grad_(True)
    b = omega0.log().clone().requires_grad_(True)

    def value(theta: Tensor, omega: Tensor) -> Tensor:
        return loss(blt_coefficients(theta, omega, horizon), horizon, patterns, decay)

    opt = torch.optim.LBFGS([a, b], lr=0.5, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        out = torch.log(value(torch.sigmoid(a), b.exp()))
        out.backward()
        return out

    opt.step(closure)
    with torch.no_grad():
        found = [(_public(t, one_minus=True), _public(w)) for t, w in ((torch.sigmoid(a), b.exp()), (theta0, omega0))]
        candidates = [*found, (theta0, torch.zeros_like(omega0))]
        ok = [c for c in candidates if bool(torch.isfinite(c[0]).all() & torch.isfinite(c[1]).all())]
        ok = [c for c in ok if bool((c[0] < 1.0).all()) and bool(torch.isfinite(value(*c)))]
        theta, omega = min(ok, key=lambda c: float(value(*c)))
    order = torch.argsort(theta, descending=True)
    return tuple(float(t) for t in theta[order]), tuple(float(w) for w in omega[order])


def chosen_blt(
    horizon: int, cycle: int, decay: float = 1.0, most: int = BLT_BUFFERS
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The BLT with the fewest buffers (1..``most``) whose loss is within :data:`BLT_TOLERANCE` of the
    best of them (each optimised by :func:`optimised_blt`): a 4-buffer optimum that a 1-buffer BLT
    matches to 1e-9 keeps 1 buffer, a quarter of the noise state."""
    patterns = cyclic_participation(horizon, cycle)
    found = []
    for buffers in range(1, max(1, min(most, horizon)) + 1):
        theta, omega = optimised_blt(horizon, buffers, cycle, decay=decay)
        coefs = blt_coefficients(
            torch.tensor(theta, dtype=torch.float64), torch.tensor(omega, dtype=torch.float64), horizon
        )
        found.append((float(loss(coefs, horizon, patterns, decay)), theta, omega))
    best = min(f[0] for f in found)
    _, theta, omega = next(f for f in found if f[0] <= best * (1.0 + BLT_TOLERANCE))
    return theta, omega


def strategy(kind: str, horizon: int, bands: int, cycle: int, decay: float = 1.0) -> Strategy:
    """The public strategy a run uses (computed from its configuration alone; a BLT with ``bands``
    0 takes the buffer count :func:`chosen_blt` finds)."""
    if kind == "independent":
        return Strategy(kind, (1.0,))
    if kind == "blt" and bands == 0:
        return Strategy(kind, (1.0,), *chosen_blt(horizon, cycle, decay))
    if not 1 <= bands <= horizon:
        raise ValueError(f"bands must be in [1, rounds={horizon}]; got {bands}")
    if kind == "banded":
        return Strategy(kind, sqrt_decay_coefficients(bands, decay))
    if kind == "optimised":
        return Strategy(kind, optimised_coefficients(horizon, bands, cycle, decay=decay))
    if kind == "blt":
        theta, omega = optimised_blt(horizon, bands, cycle, decay=decay)
        return Strategy(kind, (1.0,), theta, omega)
    raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}; got {kind!r}")


@dataclass(frozen=True)
class CorrelatedNoise:
    """A run's correlated mechanism: the strategy, its horizon T and the participation's sensitivity.

    Accounting without sampling (``sampling_rate`` 1): the T rounds are one Gaussian mechanism on Cx
    with Δ = κ·clip·s (s = ``sensitivity.value``, κ the relation's factor). With P = max
    participations and the run's per-participation multiplier z (calibrated exactly as P independent
    releases would be), the noise std is σ = z·clip·s/√P, so the joint multiplier is z/√P: the same
    guarantee as P Gaussians of z.

    Amplified (``sampling_rate`` q_g < 1, :func:`amplified_mechanism`): the units are ``cycle`` = b
    public groups, round t samples group t mod b with probability q_g, and C has at most b bands.
    A unit's participations are then ≥ b rounds apart, so each moves its own columns' rows of Cx
    (disjoint for a b-banded C), and the whole stream is dominated by ⌈T/b⌉ Poisson-sampled Gaussians
    of multiplier z with σ = z·clip·(max column norm of C) (Choquette-Choo et al. 2023, Theorem 4;
    jax_privacy's ``amplified_bandmf_event``).
    """

    strategy: Strategy
    horizon: int
    sensitivity: SensitivityResult
    cycle: int
    decay: float = 1.0
    """λ of the workload A_λ the strategy was chosen for (1: prefix sums); public, from the config."""
    sampling_rate: float = 1.0
    """q_g < 1: block-cyclic Poisson sampling within ``cycle`` groups, accounted by amplification."""
    note: str = ""
    """How the strategy was chosen (the groups under Poisson sampling), for the run's privacy summary."""
    warning: str = ""
    """Set when the strategy is worse than independent noise on its own loss (a choice the run was
    given, never made silently): the run's result carries it as a warning."""

    @property
    def amplified(self) -> bool:
        return self.sampling_rate < 1.0

    def group(self, step: int) -> int:
        """The group (public id block) round ``step`` (0-based) samples: step mod b."""
        return step % self.cycle

    def noise_std(self, noise_multiplier: float, clip: float) -> float:
        s, p = self.sensitivity.value, self.sensitivity.participations
        if noise_multiplier <= 0:
            return 0.0
        return noise_multiplier * clip * (s if self.amplified else s / math.sqrt(p))

    def params(self) -> dict[str, object]:
        return {
            "noise": self.strategy.kind,
            "bands": self.strategy.bands,
            "buffers": self.strategy.buffers,
            "strategy_digest": self.strategy.digest(),
            "horizon": self.horizon,
            "cycle": self.cycle,
            "workload_decay": self.decay,
            "unit_sensitivity": self.sensitivity.value,
            "sensitivity_rule": self.sensitivity.rule,
            "sensitivity_scope": self.sensitivity.scope,
            "participations": self.sensitivity.participations,
            **({"sampling_rate": self.sampling_rate, "groups": self.cycle} if self.amplified else {}),
        }


def mechanism(kind: str, horizon: int, bands: int, cycle: int, decay: float = 1.0) -> CorrelatedNoise:
    """The strategy for (kind, horizon, bands, cycle, λ) and its sensitivity under the K-cycle."""
    s = strategy(kind, horizon, bands, cycle, decay)
    patterns = cyclic_participation(horizon, cycle)
    found = sensitivity(s.matrix(horizon), patterns)
    scope = (
        f"this run's fixed {cycle}-cycle (cohort k in the rounds t ≡ k mod {cycle}); also any participation "
        f"at least {s.bands} rounds apart in at most {found.participations} rounds, within √P·max column norm"
        if found.rule == "orthogonal columns"
        else f"this run's fixed {cycle}-cycle only (cohort k in the rounds t ≡ k mod {cycle}): another schedule "
        "needs its own sensitivity"
    )
    noise = CorrelatedNoise(s, horizon, replace(found, scope=scope), cycle, decay)
    if kind == "banded":
        ratio = error(noise) / error(independent_cycle(horizon, cycle, decay))
        if ratio > 1.0 + 1e-9:
            return replace(
                noise,
                warning=f"noise banded ({s.bands} bands, cycle {cycle}): {ratio:.4g}× the error of independent "
                "noise on its own workload (σ² times the A_λ error); noise optimised is never worse than independent",
            )
    return noise


def independent_cycle(horizon: int, cycle: int, decay: float = 1.0) -> CorrelatedNoise:
    """Independent noise (C = I) on the K-cycle as a :class:`CorrelatedNoise` (to compare errors with)."""
    s = Strategy("independent", (1.0,))
    return CorrelatedNoise(
        s, horizon, sensitivity(s.matrix(horizon), cyclic_participation(horizon, cycle)), cycle, decay
    )


def error(noise: CorrelatedNoise, noise_multiplier: float = 1.0) -> float:
    """Total squared error of the A_λ iterates per unit clip: σ²·‖A_λ C⁻¹‖_F² at ``noise_multiplier``
    (σ as the run draws it: z·s/√P on a cycle, z·max column norm amplified)."""
    T = noise.horizon
    coefficients = noise.strategy.toeplitz_coefficients(T)
    return noise.noise_std(noise_multiplier, 1.0) ** 2 * float(prefix_error(coefficients, T, noise.decay))


def single_participation(horizon: int) -> Tensor:
    """(1, T): one participation in round 0, whose column of a Toeplitz C is the longest (its norm is
    the max column norm the amplified analysis needs)."""
    out = torch.zeros(1, horizon, dtype=torch.float64)
    out[0, 0] = 1.0
    return out


def amplified_mechanism(kind: str, horizon: int, groups: int, rate: float, decay: float = 1.0) -> CorrelatedNoise:
    """Banded C with b = ``groups`` bands for block-cyclic Poisson sampling: b public groups, round t
    samples group t mod b with probability ``rate``. At rate 1 it is the b-cycle itself (exact
    cyclic sensitivity, :func:`mechanism`). Below 1 the sensitivity is the max column norm and the
    stream is accounted as ⌈T/b⌉ Poisson-sampled Gaussians (:class:`CorrelatedNoise`); ``optimised``
    minimises max column norm² × the A_λ error (one participation: jax_privacy's ``amplified_bandmf_loss``)."""
    if kind not in ("banded", "optimised"):
        raise ValueError(
            f"noise {kind} with cohorts poisson: the amplified analysis (Choquette-Choo et al. 2023) covers banded "
            "C only (a BLT's C is not banded); use noise banded or optimised"
        )
    if not 1 <= groups <= horizon:
        raise ValueError(f"bands must be in [1, rounds={horizon}] with cohorts poisson; got {groups}")
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"sampling_rate × bands must be in (0, 1]; got {rate}")
    if rate >= 1.0:
        return mechanism(kind, horizon, groups, groups, decay)
    if kind == "banded":
        s = Strategy(kind, sqrt_decay_coefficients(groups, decay))
    else:
        s = Strategy(
            kind, optimised_coefficients(horizon, groups, groups, decay=decay, patterns=single_participation(horizon))
        )
    column = math.sqrt(float((s.matrix(horizon) ** 2).sum(0).max()))
    found = SensitivityResult(
        column,
        "max column norm (amplified: b-min-separated participation, Choquette-Choo et al. 2023, Theorem 4)",
        -(-horizon // groups),
        f"block-cyclic Poisson: {groups} public id blocks, block g sampled at q = {rate:.6g} in the rounds "
        f"t ≡ g mod {groups}; any participation at least {groups} rounds apart, at most ⌈T/b⌉ = "
        f"{-(-horizon // groups)} times",
    )
    return CorrelatedNoise(s, horizon, found, groups, decay, sampling_rate=rate)


def sampled_groups(rate: float, horizon: int) -> list[int]:
    """Candidate group counts b under Poisson sampling at expected rate q: the divisors of T (every group
    gets the same number of rounds) with q·b ≤ 1 (b = 1: plain Poisson sampling, independent noise)."""
    most = min(horizon, math.floor(1.0 / rate + 1e-9))
    return [b for b in range(1, most + 1) if horizon % b == 0]


def poisson_independent(horizon: int, rate: float, decay: float = 1.0) -> CorrelatedNoise:
    """Plain Poisson sampling at q with independent noise (one group, C = I) as a :class:`CorrelatedNoise`:
    its stream draws exactly the noise of independent releases, each a Poisson-sampled Gaussian."""
    found = SensitivityResult(1.0, "one band (C = I)", horizon, "any Poisson-sampled participation")
    return CorrelatedNoise(Strategy("independent", (1.0,)), horizon, found, 1, decay, sampling_rate=rate)


def sampled_mechanism(
    kind: str,
    horizon: int,
    bands: int,
    rate: float,
    multiplier: Callable[[int], float],
    decay: float = 1.0,
) -> CorrelatedNoise:
    """The correlated mechanism of a Poisson-sampled run at expected rate q (each round takes q·n units in
    expectation, whatever b): b groups sampled at q·b (:func:`amplified_mechanism`). ``bands`` b > 0 is
    used as given (and noted when independent Poisson noise would do better); 0 chooses b among
    :func:`sampled_groups` by the error the run would have: ``multiplier(b)``² (the per-participation z
    the run's (ε, δ) needs with b groups) times the strategy's :func:`error` at z = 1 — the amplified
    trade-off (fewer bands, more amplification; more bands, more correlation). b = 1 is plain Poisson
    sampling with independent noise (:func:`poisson_independent`)."""
    if bands and rate * bands > 1.0 + 1e-9:
        raise ValueError(
            f"bands must be <= 1/sampling_rate = {1.0 / rate:.6g} with cohorts poisson (each of the b groups is "
            f"sampled at sampling_rate × b); got {bands}"
        )
    options = [bands] if bands else sampled_groups(rate, horizon)

    def candidate(b: int) -> tuple[float, CorrelatedNoise]:
        noise = (
            poisson_independent(horizon, rate, decay)
            if b == 1
            else amplified_mechanism(kind, horizon, b, min(1.0, rate * b), decay)
        )
        return error(noise, multiplier(b)), noise

    scored = [candidate(b) for b in options]
    value, noise = min(scored, key=lambda c: c[0])
    plain = scored[0][0] if options[0] == 1 else candidate(1)[0]
    b = noise.cycle if noise.strategy.kind != "independent" else 1
    what = (
        f"{b} groups sampled at {min(1.0, rate * b):.6g} with {kind} noise"
        if b > 1
        else "independent noise with plain Poisson sampling"
    )
    text = f"{what}: {value / plain:.4g}× the error of independent Poisson noise (σ² times the A_λ error)"
    if bands and value > plain * (1.0 + 1e-9):
        warning = f"noise {kind} with bands {bands} under cohorts poisson: {text}; bands 0 chooses b"
        return replace(noise, note=text, warning=warning)
    return replace(noise, note=f"chose {text}, b among {', '.join(map(str, options))}" if not bands else text)


@dataclass
class NoiseRecurrence:
    """Round t's slice of C⁻¹z, by forward substitution of C w = z.

    Banded: w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0, keeping the b − 1 last w. BLT (``buf_decay``
    θ, ``output_scale`` ω): w_t = z_t − Σ_i ω_i β_i with buffers β_i = Σ_{k≥1} θ_i^(k−1) w_{t−k},
    updated β_i ← θ_i β_i + w_t: one vector per buffer (jax_privacy's ``build_inverse``)."""

    coefficients: tuple[float, ...]
    step: int = 0
    history: list[Tensor] = field(default_factory=list)
    """Banded: the last b − 1 noise vectors w, most recent first; BLT: the buffers β (float64)."""
    buf_decay: tuple[float, ...] = ()
    output_scale: tuple[float, ...] = ()

    def spec(self) -> tuple[tuple[float, ...], ...]:
        return (self.coefficients, self.buf_decay, self.output_scale)

    def offset(self, shape: tuple[int, ...]) -> Tensor:
        """w_t − z_t/c_0 (float64, CPU): the part of round t's noise the earlier rounds fix
        (−Σ_j c_j w_{t−j}/c_0, or −Σ_i ω_i β_i). With it, round t's noise is an independent
        Gaussian draw plus this offset, which is how ``secure_noise`` draws it (:meth:`push`)."""
        out = torch.zeros(shape, dtype=torch.float64)
        if self.buf_decay:
            for omega, beta in zip(self.output_scale, self.history, strict=False):
                out = out - omega * beta
            return out
        for c, past in zip(self.coefficients[1:], self.history, strict=False):
            out = out - c * past
        return out / self.coefficients[0]

    def push(self, w: Tensor) -> None:
        """Record round t's noise w_t (float64) as drawn elsewhere (z_t/c_0 + :meth:`offset`) and step on."""
        w = w.to("cpu", torch.float64)
        if self.buf_decay:
            buffers = self.history or [torch.zeros_like(w) for _ in self.buf_decay]
            self.history = [theta * beta + w for theta, beta in zip(self.buf_decay, buffers, strict=True)]
        else:
            self.history = [w, *self.history][: len(self.coefficients) - 1]
        self.step += 1

    def next(self, z: Tensor) -> Tensor:
        w = z.clone()
        if self.buf_decay:
            for omega, beta in zip(self.output_scale, self.history, strict=False):
                w = w - omega * beta
        else:
            for c, past in zip(self.coefficients[1:], self.history, strict=False):
                w = w - c * past
            w = w / self.coefficients[0]
        self.push(w)
        return w


def summary(noise: CorrelatedNoise) -> dict[str, object]:
    """A run's correlated mechanism for its privacy summary: the strategy, its sensitivity, the
    schedules that sensitivity holds for, the accounting, and how it was chosen."""
    out: dict[str, object] = {
        "noise": noise.strategy.kind,
        "bands": noise.strategy.bands,
        "buffers": noise.strategy.buffers,
        "workload_decay": noise.decay,
        "unit_sensitivity": noise.sensitivity.value,
        "sensitivity_rule": noise.sensitivity.rule,
        "sensitivity_scope": noise.sensitivity.scope,
        "participations": noise.sensitivity.participations,
        "correlated_accounting": "amplified: per group ⌈T/b⌉ Poisson-sampled Gaussians (Choquette-Choo et al. 2023)"
        if noise.amplified
        else "one Gaussian on Cx (joint multiplier z/√P)",
    }
    if noise.amplified:
        out.update(groups=noise.cycle, group_sampling_rate=noise.sampling_rate)
    if noise.note:
        out["strategy_note"] = noise.note
    if noise.warning:
        out["strategy_warning"] = noise.warning
    return out


def sampling_text(cohorts: str, rate: float, cycle: int, group_rate: float) -> str:
    """Who takes part in each round, as run (``cycle`` and ``group_rate``: the protocol's)."""
    if cohorts == "poisson" and cycle > 1:
        if group_rate >= 1.0:
            return f"the {cycle}-cycle of id blocks (cohorts poisson at q = {rate:g} with b = {cycle}: q·b = 1)"
        return (
            f"block-cyclic poisson: {cycle} id blocks taken in turn, each sampled at q·b = {group_rate:g} "
            f"(expected share q = {rate:g})"
        )
    if cohorts == "poisson":
        return f"poisson q={rate}"
    if cohorts == "cyclic":
        return f"cyclic: {cycle} cohorts by id blocks, round r uses cohort (r − 1) mod {cycle}"
    return "all units every round"


def cycle_of(cohorts: str, cycle: int) -> int:
    """K of a run: --cycle with cohorts cyclic, else 1 (every user, or Poisson, every round)."""
    return cycle if cohorts == "cyclic" else 1


def run_mechanism(noise: str, rounds: int, bands: int, cycle: int, decay: float = 1.0) -> CorrelatedNoise:
    """The public strategy and its sensitivity under the run's cycle (bands 0: b = min(K, T); for a
    BLT, bands is its number of buffers, 0: the fewest of 1..4 the optimiser needs, :func:`chosen_blt`)
    for the workload A_λ (``decay`` λ; 1: prefix sums)."""
    default = 0 if noise == "blt" else min(cycle, rounds)
    return mechanism(noise, rounds, bands or default, cycle, decay)
