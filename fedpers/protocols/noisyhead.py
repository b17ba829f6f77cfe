"""NoisyHead (docs/algorithms.md §2): DP gradient descent on the linear attention head Γ.

Clients hold prompts. Prompt k gives ``vec Z̃_k = vec Π_G((1/L) x_{k,L+1} Σ_i clip(y_{k,i}; C) x_{k,i}ᵀ)``
and ``ỹ_k = clip(y_{k,L+1}; C)``; the server runs T steps of

    Γ ← Π_R((1 − 2λη₀) Γ − (η₀/N) (Σ_k (<Γ, Z̃_k> − ỹ_k) Z̃_k + noise_t))

where ``noise_t`` is the Gaussian noise the :class:`~fedpers.privacy.Privatizer` adds to the
summed gradient, so docs/algorithms.md's ``z_t`` is ``(η₀/N)·noise_t``. With ``||Γ|| ≤ R`` (the projection keeps
it there) one prompt's gradient has norm ≤ ``G(C + RG)``: that is the per-unit bound of every
release and ``2G(C + RG) = σ`` its replace-one sensitivity.

Two server modes give the same Γ̂ for one noise seed (the same T draws, in the same order):

- ``statistics`` (one round): clients send ``Σ vec Z̃ vec Z̃ᵀ`` and ``Σ ỹ vec Z̃``; the server
  forms each step's gradient ``A vec Γ − b`` itself.
- ``rounds`` (T rounds): the server broadcasts Γ; clients return ``Σ (<Γ, Z̃_k> − ỹ_k) Z̃_k``.

User level: a unit is a user's P prompts. Its statistics ``A_u = Σ_k vec Z̃ vec Z̃ᵀ`` and
``b_u = Σ_k ỹ_k vec Z̃`` are clipped (Frobenius) to ``ρP·G²`` and ``ρP·CG``, so the user's gradient
``A_u vec Γ − b_u`` has norm ≤ ``ρP·G(C + RG)``. Both modes use the same clip factors (they do
not depend on Γ), which keeps them identical. With ``P = 1, ρ = 1`` this is the prompt level and
the clip never acts.

Everything here is batched over arbitrary leading dimensions (units, or Monte-Carlo
repetitions) and vectorises Γ by stacking columns: ``vec(x sᵀ) = s ⊗ x``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedpers import linalg
from fedpers.configs.noisyhead import Mode, RidgeScaling
from fedpers.privacy import ALL_UNITS, Privatizer
from fedpers.privacy.adaptive_clip import (
    COUNT_BOUND,
    AdaptiveClip,
    SplitRoundBudget,
    below_statistic,
)
from fedpers.privacy.correlated import CorrelatedNoise
from fedpers.protocols.base import (
    Message,
    NodeSide,
    Protocol,
    StatSpec,
    Units,
    UnitStatistics,
    all_take_part,
    cohort_size,
    round_release,
)

Tensor = torch.Tensor


# ----- Theorem 4.1 ------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadConstants:
    """Clipping / projection constants of Theorem 4.1 and the noise scale σ = 2G(C + RG)."""

    nu: float
    C: float
    G: float
    G0: float
    R: float

    @property
    def sigma(self) -> float:
        return 2 * self.G * (self.C + self.R * self.G)


FORMULAS = {
    "nu": "ν = 1 + τ²",
    "C": "C = sqrt(2ν log(NL/κ))",
    "G": "G = (C/√L)(1 + sqrt(log(N/κ))/D)",
    "G0": "G₀ = (C/√L)(1 + sqrt(log(1/κ))/D)",
    "R": "R = λ⁻¹ C² sqrt(N/L)(1 + sqrt(log(1/κ))/D)",
    "sigma": "σ = 2G(C + RG)",
}


def theorem41_constants(n: int, context: int, dim: int, tau: float, kappa: float, lam: float) -> HeadConstants:
    """ν, C, G, G₀, R of Theorem 4.1 (eq. 4.1) for N prompts of context L in dimension D."""
    if not (n >= 1 and context >= 1 and dim >= 1):
        raise ValueError(f"N, L, D must be >= 1; got N={n}, L={context}, D={dim}")
    if not 0 < kappa <= 1:
        raise ValueError(f"kappa must be in (0, 1]; got {kappa}")
    if not lam > 0:
        raise ValueError(f"ridge_lambda must be > 0 for R = C²sqrt(N/L)/λ; got {lam}")
    nu = 1 + tau**2
    C = math.sqrt(2 * nu * math.log(n * context / kappa))
    G = C / math.sqrt(context) * (1 + math.sqrt(math.log(n / kappa)) / dim)
    G0 = C / math.sqrt(context) * (1 + math.sqrt(math.log(1 / kappa)) / dim)
    R = C**2 * math.sqrt(n / context) * (1 + math.sqrt(math.log(1 / kappa)) / dim) / lam
    return HeadConstants(nu, C, G, G0, R)


def paper_noise_multiplier(steps: int, epsilon: float, delta: float) -> float:
    """z of the paper's calibration: each step (ε/T, δ/T) by the classical Gaussian formula.

    Per step σ_step = Δ sqrt(2 log(1.25T/δ)) T/ε with Δ = 2 × per-unit bound, so
    z = σ_step / bound = 2T sqrt(2 log(1.25T/δ))/ε. On Γ this is docs/algorithms.md's
    Var z_t = 2η₀²T²σ² log(1.25T/δ)/(ε²N²) with σ = Δ.
    """
    if math.isinf(epsilon):
        return 0.0
    return 2 * steps * math.sqrt(2 * math.log(1.25 * steps / delta)) / epsilon


def paper_epsilon(noise_multiplier: float, steps: int, delta: float) -> float:
    """The ε the paper's calibration claims for noise multiplier z (inverse of :func:`paper_noise_multiplier`)."""
    if noise_multiplier == 0:
        return math.inf
    return 2 * steps * math.sqrt(2 * math.log(1.25 * steps / delta)) / noise_multiplier


# ----- the math, batched over leading dims ------------------------------------------------
def prompt_vectors(x: Tensor, y: Tensor, clip_c: float = math.inf, proj_g: float = math.inf) -> tuple[Tensor, Tensor]:
    """(vec Z̃, ỹ) of prompts: x (..., L+1, D), y (..., L+1) -> (..., D²), (...).

    The last token is the query. ``clip_c = proj_g = inf`` gives the raw Z and y_{L+1}.
    With a finite G, Z̃ = min(||s||·||x_q||, G)·(ŝ ⊗ x̂_q) (||Z||_F = ||s||·||x_q|| for the
    outer product Z = s x_qᵀ), formed from directions and log-norms so it is finite with
    ||Z̃|| ≤ G for every finite input.
    """
    L = x.shape[-2] - 1
    if L < 1:
        raise ValueError(f"a prompt needs at least one context token and a query; got {x.shape[-2]} tokens")
    yc = linalg.clip_scalar(y[..., :L], clip_c)
    yq = linalg.clip_scalar(y[..., L], clip_c)
    if math.isinf(proj_g):
        s = (yc.unsqueeze(-1) * x[..., :L, :]).sum(-2) / L
        return (s.unsqueeze(-1) * x[..., L, :].unsqueeze(-2)).flatten(-2), yq
    context = x[..., :L, :]
    scale = linalg.pow2_scale(context, 2)
    s_hat, log_s = linalg.directions((yc.unsqueeze(-1) * (context / scale[..., None, None])).sum(-2) / L)
    q_hat, log_q = linalg.directions(x[..., L, :])
    size = linalg.clipped_magnitude(log_s + scale.double().log() + log_q, proj_g).to(x.dtype)
    z = ((s_hat * size.unsqueeze(-1)).unsqueeze(-1) * q_hat.unsqueeze(-2)).flatten(-2)
    return z, yq


def unit_clip_factors(z: Tensor, yq: Tensor, a_bound: float, b_bound: float) -> tuple[Tensor, Tensor]:
    """Per-unit clip factors of A_u = Σ_k z_k z_kᵀ and b_u = Σ_k ỹ_k z_k; z (..., P, D²), yq (..., P).

    ``||A_u||_F² = Σ_{k,l} <z_k, z_l>²`` comes from the P×P Gram matrix, so no D²×D² matrix per
    unit is formed.
    """
    gram = z @ z.transpose(-1, -2)
    a_norm = torch.linalg.matrix_norm(gram)
    b_norm = torch.linalg.vector_norm((yq.unsqueeze(-1) * z).sum(-2), dim=-1)
    return linalg.clip_factor(a_norm, a_bound), linalg.clip_factor(b_norm, b_bound)


def gram_statistics(z: Tensor, yq: Tensor, wa: Tensor | None = None, wb: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A = Σ_k w_a,k z_k z_kᵀ and b = Σ_k w_b,k ỹ_k z_k over the prompt dim (-2); z (..., n, D²)."""
    za = z if wa is None else z * wa.unsqueeze(-1)
    A = za.transpose(-1, -2) @ z
    b = ((yq if wb is None else yq * wb).unsqueeze(-2) @ z).squeeze(-2)
    return A, b


def gradient_sum(gamma: Tensor, z: Tensor, yq: Tensor, wa: Tensor | None = None, wb: Tensor | None = None) -> Tensor:
    """Σ_k (w_a,k <γ, z_k> − w_b,k ỹ_k) z_k without forming A; gamma (..., D²), z (..., n, D²)."""
    pred = (z @ gamma.unsqueeze(-1)).squeeze(-1)
    resid = (pred if wa is None else wa * pred) - (yq if wb is None else wb * yq)
    return (resid.unsqueeze(-2) @ z).squeeze(-2)


def unit_gradients(gamma: Tensor, z: Tensor, yq: Tensor, wa: Tensor | None = None, wb: Tensor | None = None) -> Tensor:
    """:func:`gradient_sum` per unit, z (U, P, D²) → (U, D²), each unit's bits those of its prompts alone:
    elementwise products summed, since a matrix product's kernel (its summation order) depends on how many
    rows it is given."""
    pred = (z * gamma).sum(-1)
    resid = (pred if wa is None else wa * pred) - (yq if wb is None else wb * yq)
    return (resid.unsqueeze(-1) * z).sum(-2)


def descend(gamma: Tensor, noisy_grad_sum: Tensor, n: float, lam: float, eta: float, radius: float) -> Tensor:
    """One step: Π_R((1 − 2λη₀)γ − (η₀/N)·(noisy gradient sum)), batched over leading dims; ``n`` is
    N, or its expectation qN under Poisson sampling."""
    return linalg.clip_vectors((1 - 2 * lam * eta) * gamma - (eta / n) * noisy_grad_sum, radius)


def ridge(A: Tensor, b: Tensor, n: int, lam: float, scaling: RidgeScaling = RidgeScaling.MATCHED) -> Tensor:
    """vec Γ* = (cλN I + A)⁻¹ b with c = 2 (matched to GD's objective) or 1 (eq. 2.7); batched."""
    k = A.shape[-1]
    eye = torch.eye(k, dtype=A.dtype, device=A.device)
    M = A + scaling.factor * lam * n * eye
    chol, info = torch.linalg.cholesky_ex(M)
    if bool((info == 0).all()):
        return torch.cholesky_solve(b.unsqueeze(-1), chol).squeeze(-1)
    return torch.linalg.solve(M, b)


def gd(A: Tensor, b: Tensor, gamma0: Tensor, n: int, lam: float, eta: float, steps: int) -> Tensor:
    """Non-private GD on (1/2N)Σ(<Γ, Z_k> − y_k)² + λ||Γ||² (no clipping, projection or noise)."""
    gamma = gamma0
    for _ in range(steps):
        gamma = (1 - 2 * lam * eta) * gamma - (eta / n) * ((A @ gamma.unsqueeze(-1)).squeeze(-1) - b)
    return gamma


def vec_to_gamma(v: Tensor) -> Tensor:
    """(..., D²) column-stacked -> (..., D, D)."""
    d = math.isqrt(v.shape[-1])
    return v.reshape(*v.shape[:-1], d, d).transpose(-1, -2)


def gamma_to_vec(g: Tensor) -> Tensor:
    return g.transpose(-1, -2).flatten(-2)


# ----- the protocol -----------------------------------------------------------------------
@dataclass(frozen=True)
class NoisyHeadProtocol(SplitRoundBudget, Protocol):
    """Public parameters of one NoisyHead run (all data-independent)."""

    prompts: int
    dim: int
    context: int
    steps: int
    step_size: float
    ridge_lambda: float
    clip_c: float
    proj_g: float
    proj_r: float
    noise_multiplier: float
    mode: Mode = Mode.STATISTICS
    prompts_per_unit: int = 1
    unit_clip: float = 1.0
    gamma0: tuple[float, ...] = ()
    unit_name: str = "prompt"
    sampling_rate: float = 1.0
    """q < 1 (rounds mode): each step includes every unit independently with probability q,
    drawn on the server from the Privatizer's sampling generator; the noisy sum is divided by
    the public q·N (not the sampled count)."""
    cycle: int = 1
    """K > 1 (rounds mode): K fixed cohorts of units by id blocks (unit i in ⌊iK/U⌋); step t (0-based)
    uses cohort t mod K and divides its noisy sum by the cohort's public prompt count."""
    correlated: CorrelatedNoise | None = None
    """Correlated noise across the T steps (None: independent Gaussian noise per step)."""
    clip_quantile: float = 0.0
    """γ > 0 (rounds mode): adaptive clipping of each unit's gradient (Andrew et al. 2021): the bound
    B_t starts at ρP·G(C + RG) and moves toward the γ-quantile of ‖A_u vec Γ − b_u‖ through a noisy
    count of the units within it (docs/algorithms.md §6)."""
    clip_lr: float = 0.2
    """η_C: the adaptive bound's geometric step."""
    count_share: float = 0.0
    """f: share of each step's μ² (1/z²) spent on the count (0 without adaptive clipping)."""

    name = "noisyhead"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1; got {self.steps}")
        if self.gamma0 and len(self.gamma0) != self.dim**2:
            raise ValueError(f"gamma0 must have D² = {self.dim**2} entries; got {len(self.gamma0)}")
        if not 0 < self.unit_clip <= 1:
            raise ValueError(f"unit_clip must be in (0, 1]; got {self.unit_clip}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1]; got {self.sampling_rate}")
        if self.sampling_rate < 1 and self.mode is not Mode.ROUNDS:
            raise ValueError("sampling_rate < 1 needs mode rounds (each step samples its units)")
        if self.cycle > 1 and self.mode is not Mode.ROUNDS:
            raise ValueError("cycle > 1 needs mode rounds (each step reads its cohort)")
        if self.cycle > 1 and self.sampling_rate < 1 and (self.correlated is None or not self.correlated.amplified):
            raise ValueError(
                "cycle > 1 with Poisson sampling is the amplified correlated noise's block-cyclic schedule only"
            )
        if self.adaptive and self.mode is not Mode.ROUNDS:
            raise ValueError(
                "clip_quantile > 0 (adaptive clipping) needs mode rounds (statistics keeps the analytic bounds)"
            )

    # ----- cyclic cohorts (public) ----------------------------------------------------------
    def cohort_of(self, ids: Tensor) -> Tensor:
        return torch.div(ids.to(torch.int64) * self.cycle, self.units_total, rounding_mode="floor")

    def cohort_range(self, cohort: int) -> tuple[int, int]:
        """[start, stop) of the unit ids in ``cohort`` (⌈kU/K⌉ .. ⌈(k+1)U/K⌉)."""
        n, K = self.units_total, self.cycle
        return -(-cohort * n // K), -(-(cohort + 1) * n // K)

    def participations(self) -> int:
        """Steps a unit takes part in: ⌈T/K⌉."""
        return -(-self.steps // self.cycle)

    def step_divisor(self, t: int) -> float:
        """Public N of step t: all prompts, their expectation qN, or the cohort's prompts (times q when a
        cohort is Poisson-sampled: the amplified block-cyclic schedule)."""
        if self.cycle > 1:
            start, stop = self.cohort_range(t % self.cycle)
            return float((stop - start) * self.prompts_per_unit) * self.sampling_rate
        return self.prompts * self.sampling_rate

    def units_in_round(self, round: int, units: Units) -> int:
        if self.cycle > 1:
            return int((self.cohort_of(units["ids"]) == round % self.cycle).sum())
        return int(units["ids"].shape[0])

    def units_needed(self, round: int, broadcast: Mapping[str, Tensor]) -> tuple[Tensor | None, tuple[int, int] | None]:
        sampled = self.poisson and "sampled" in broadcast  # the server's sample, sent with the broadcast
        if self.cycle > 1 or sampled:
            # the round's block of ids (cycle), of which the sampled ones (Poisson)
            ids = torch.arange(*self.cohort_range(round % self.cycle))
            if sampled:
                ids = ids[broadcast["sampled"].cpu()[ids] > 0]
            return ids, None
        return None, None

    def unit_divisor(self, t: int) -> float:
        """Public number of units of step t: all, their expectation qU, or the cohort's (the count's divisor)."""
        if self.cycle > 1:
            start, stop = self.cohort_range(t % self.cycle)
            return float(stop - start) * self.sampling_rate
        return self.units_total * self.sampling_rate

    @property
    def poisson(self) -> bool:
        return self.sampling_rate < 1

    @property
    def units_total(self) -> int:
        return self.prompts // self.prompts_per_unit

    @property
    def num_rounds(self) -> int:
        return 1 if self.mode is Mode.STATISTICS else self.steps

    # ----- privacy bookkeeping -------------------------------------------------------
    @property
    def unit_scale(self) -> float:
        return self.unit_clip * self.prompts_per_unit

    @property
    def grad_bound(self) -> float:
        """Per-unit norm bound of the released gradient sum: ρP·G(C + RG)."""
        return self.unit_scale * self.proj_g * (self.clip_c + self.proj_r * self.proj_g)

    @property
    def a_bound(self) -> float:
        return self.unit_scale * self.proj_g**2

    @property
    def b_bound(self) -> float:
        return self.unit_scale * self.clip_c * self.proj_g

    @property
    def noise_std_sum(self) -> float:
        """σ of the Gaussian added to the summed gradient each step (of z before C⁻¹ when correlated)."""
        if self.correlated is not None:
            return self.correlated.noise_std(self.noise_multiplier, self.grad_bound)
        return self.noise_multiplier * self.grad_bound if self.noise_multiplier > 0 else 0.0

    @property
    def noise_std_step(self) -> float:
        """Std of each entry of docs/algorithms.md's z_t (the noise on Γ): (η₀/N)·σ_sum."""
        return self.step_size / self.prompts * self.noise_std_sum

    @property
    def step_sensitivity(self) -> float:
        """Replace-one change of one step's update of Γ: (η₀/N)·2ρP·G(C + RG)."""
        return self.step_size / self.prompts * 2 * self.grad_bound

    # ----- protocol ------------------------------------------------------------------
    def node_side(self) -> NodeSide | str:
        """``--mode rounds`` releases each step's gradient sum at z; the statistics mode releases A·Γ_t − b, a
        transform the server computes from the sums at each of its T steps (node-side it would be the gradient
        of every step: the rounds mode)."""
        if self.mode is Mode.STATISTICS:
            return (
                "noisyhead --mode statistics (it releases A·Γ − b, a transform of the sums computed on the server "
                "at every step; use --mode rounds, whose every release is a gradient sum)"
            )
        if self.adaptive:
            return f"{self.name} with adaptive clipping (its count releases; use --clip-rule fixed)"
        if self.correlated is not None:
            return f"{self.name} with correlated noise (its noise is correlated across steps; use --noise independent)"
        if self.poisson:
            return f"{self.name} with Poisson sampling (sampling_rate < 1)"
        return NodeSide(self.noise_multiplier)

    def unit_keys(self) -> tuple[str, ...]:
        return ("x", "y")

    def initial_gamma(self) -> Tensor:
        if not self.gamma0:
            return torch.zeros(self.dim**2, dtype=self.dtype)
        return linalg.clip_vectors(torch.tensor(self.gamma0, dtype=self.dtype), self.proj_r)

    def initial_state(self) -> dict[str, Tensor]:
        if self.adaptive:  # B_1: the analytic bound
            return {"gamma": self.initial_gamma(), "clip": torch.tensor(self.grad_bound, dtype=torch.float64)}
        return {"gamma": self.initial_gamma()}

    def server_start(self, state: dict[str, Tensor], privatizer: Privatizer) -> dict[str, Tensor]:
        return self._next_sample(state, privatizer)

    def _next_sample(self, state: dict[str, Tensor], privatizer: Privatizer) -> dict[str, Tensor]:
        if self.poisson:
            state["sampled"] = privatizer.poisson_sample(self.units_total, self.sampling_rate).to(torch.float64)
        return state

    def broadcast(self, state: Mapping[str, Tensor], round: int) -> dict[str, Tensor]:
        if self.mode is Mode.STATISTICS:
            return {}
        out = {"gamma": state["gamma"]}
        if self.poisson:  # this step's membership (see docs/fedrep.md: who may see it)
            out["sampled"] = state["sampled"]
        if self.adaptive:  # B_t: public, made from released counts only
            out["clip"] = state["clip"]
        return out

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        k = self.dim**2
        if self.mode is Mode.STATISTICS:
            return (StatSpec("A", (k, k), self.a_bound, symmetric=True), StatSpec("b", (k,), self.b_bound))
        if self.adaptive:  # Σ clip(g_u; B_t)/B_t and Σ (1[‖g_u‖ ≤ B_t] − 1/2): bounds that do not depend on B_t
            return (StatSpec("grad", (k,), 1.0), StatSpec("below", (), COUNT_BOUND))
        return (StatSpec("grad", (k,), self.grad_bound),)

    def features(self, units: Units) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """vec Z̃ (U, P, D²), ỹ (U, P), and the per-unit clip factors (None at the prompt level)."""
        x, y = units["x"].to(self.dtype), units["y"].to(self.dtype)
        expect = (self.prompts_per_unit, self.context + 1, self.dim)
        if x.dim() != 4 or tuple(x.shape[1:]) != expect or tuple(y.shape) != tuple(x.shape[:3]):
            raise ValueError(
                f"units: x must be (units, {expect[0]}, {expect[1]}, {expect[2]}) and y (units, P, L+1); got {tuple(x.shape)}, {tuple(y.shape)}"
            )
        z, yq = prompt_vectors(x, y, self.clip_c, self.proj_g)
        if self.prompts_per_unit == 1 and self.unit_clip == 1:
            return z, yq, None, None  # ||z zᵀ|| = ||z||² ≤ G², |ỹ|·||z|| ≤ CG: the unit clip cannot act
        ca, cb = unit_clip_factors(z, yq, self.a_bound, self.b_bound)
        P = self.prompts_per_unit
        return z, yq, ca.unsqueeze(-1).expand(-1, P), cb.unsqueeze(-1).expand(-1, P)

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        if self.poisson:
            keep = broadcast["sampled"].to(units["ids"].device)[units["ids"]] > 0
            if not all_take_part(keep):
                units = {k: v[keep] for k, v in units.items()}
        if self.cycle > 1:
            keep = self.cohort_of(units["ids"]) == round % self.cycle
            if not all_take_part(keep):
                units = {k: v[keep] for k, v in units.items()}
        z, yq, wa, wb = self.features(units)
        if self.adaptive and self.mode is Mode.ROUNDS:
            return self.scaled_gradients(broadcast, z, yq, wa, wb, int(units["ids"].shape[0]))
        k = self.dim**2
        z, yq = z.reshape(-1, k), yq.reshape(-1)
        wa = None if wa is None else wa.reshape(-1)
        wb = None if wb is None else wb.reshape(-1)
        count = int(units["ids"].shape[0])
        if self.mode is Mode.STATISTICS:
            A, b = gram_statistics(z, yq, wa, wb)
            return Message({"A": A, "b": b}, count)
        # A client never trusts Γ to be in the ball: its contribution's bound depends on it.
        gamma = linalg.clip_vectors(broadcast["gamma"].to(z.device, self.dtype), self.proj_r)
        if count == 1:  # one unit (the nodes' per-unit path): the batched path's bits (unit_statistics)
            one = unit_gradients(
                gamma, z.unsqueeze(0), yq.unsqueeze(0), *(None if w is None else w.unsqueeze(0) for w in (wa, wb))
            )
            return Message({"grad": one[0]}, count)
        return Message({"grad": gradient_sum(gamma, z, yq, wa, wb)}, count)

    def unit_statistics(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> UnitStatistics | None:
        """Each unit's own gradient, batched (``--mode rounds``, fixed clip): its prompts' features and
        gradient as :meth:`client_update` forms them for the unit alone, for every unit at once; a unit whose
        norms that path would not trust as computed (:func:`~fedpers.linalg.trusted_rows`) is left alone."""
        if self.mode is not Mode.ROUNDS or self.adaptive or self.poisson:
            return None
        ids = units["ids"]
        taking = torch.arange(int(ids.shape[0]), device=ids.device)
        if self.cycle > 1:
            taking = taking[self.cohort_of(ids) == round % self.cycle]
        x, y = units["x"][taking].to(self.dtype), units["y"][taking].to(self.dtype)
        ok = torch.ones(int(taking.shape[0]), dtype=torch.bool, device=ids.device)
        if not math.isinf(self.proj_g) and x.shape[0]:
            L = x.shape[-2] - 1
            context = x[..., :L, :]
            scale = linalg.pow2_scale(context, 2)
            yc = linalg.clip_scalar(y[..., :L], self.clip_c)
            s_vec = (yc.unsqueeze(-1) * (context / scale[..., None, None])).sum(-2) / L
            ok = linalg.trusted_rows(s_vec) & linalg.trusted_rows(x[..., L, :])  # directions: as alone
        part = {"x": units["x"][taking[ok]], "y": units["y"][taking[ok]]}
        z, yq, wa, wb = self.features(part)
        gamma = linalg.clip_vectors(broadcast["gamma"].to(z.device, self.dtype), self.proj_r)
        grad = unit_gradients(gamma, z, yq, wa, wb)
        return UnitStatistics(ids[taking[ok]], {"grad": grad}, taking[~ok])

    def scaled_gradients(
        self,
        broadcast: Mapping[str, Tensor],
        z: Tensor,
        yq: Tensor,
        wa: Tensor | None,
        wb: Tensor | None,
        count: int,
    ) -> Message:
        """Adaptive rounds: Σ_u clip(g_u; B_t)/B_t (each of norm ≤ 1) and Σ_u (1[‖g_u‖ ≤ B_t] − 1/2),
        g_u = A_u vec Γ − b_u the unit's gradient (norm ≤ ρP·G(C + RG), so finite), clipped through
        log-norms so nothing overflows for a small B_t."""
        gamma = linalg.clip_vectors(broadcast["gamma"].to(z.device, self.dtype), self.proj_r)
        g = gradient_sum(gamma, z, yq, wa, wb)  # (units, D²): one gradient per unit
        log_clip = math.log(float(broadcast["clip"]))
        g_hat, log_g = linalg.directions(g)
        scaled = g_hat * linalg.clipped_magnitude(log_g - log_clip, 1.0).to(g.dtype).unsqueeze(-1)
        return Message({"grad": scaled.sum(0), "below": below_statistic(log_g <= log_clip, self.dtype)}, count)

    def noisy_step(
        self, t: int, gamma: Tensor, grad: Tensor, privatizer: Privatizer, clip: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """Release step t's gradient sum and descend. ``clip`` B_t (adaptive): ``grad`` is Σ clip(g_u; B_t)/B_t,
        released at bound 1 with multiplier z/√(1 − f) and scaled back by the public B_t after the noise."""
        bound = self.grad_bound if clip is None else 1.0
        z = self.noise_multiplier if clip is None else self.round_multiplier
        noisy = round_release(
            privatizer,
            grad,
            correlated=self.correlated,
            per_unit_bound=bound,
            noise_multiplier=z,
            stream="grad",
            step=t,
            name=f"step{t}",
            round=t,
            units=f"cohort:{t % self.cycle}" if self.cycle > 1 else ALL_UNITS,
            params=self.step_params(t, clip),
            sampling_probability=self.sampling_rate if self.poisson and self.noise_multiplier > 0 else 1.0,
        )
        if clip is not None:
            noisy = noisy * clip
        return descend(gamma, noisy, self.step_divisor(t), self.ridge_lambda, self.step_size, self.proj_r), noisy

    def step_params(self, t: int, clip: float | None = None) -> dict[str, Any]:
        adaptive = {"B_t": clip, "formula": "bound 1 on clip(g_u; B_t)/B_t, Δ = 2; × B_t after noise"}
        return {
            "statistic": f"Σ_{self.unit_name} gradient",
            "C": self.clip_c,
            "G": self.proj_g,
            "R": self.proj_r,
            "P": self.prompts_per_unit,
            "rho": self.unit_clip,
            "formula": "bound ρP·G(C + RG), Δ = 2·bound",
            **({"sampling": f"poisson q={self.sampling_rate}", "poisson_sample": f"step{t}"} if self.poisson else {}),
            **({"cohorts": f"cyclic K={self.cycle}, cohort {t % self.cycle}"} if self.cycle > 1 else {}),
            **(adaptive if clip is not None else {}),
        }

    def server_update(
        self, round: int, state: Mapping[str, Tensor], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        device = next(iter(summed.stats.values())).device
        gamma = state["gamma"].to(device)  # Γ lives where the sums are (the run's device)
        projected = 0
        if self.mode is Mode.STATISTICS:
            A, b = summed.stats["A"], summed.stats["b"]
            for t in range(self.steps):
                gamma, _ = self.noisy_step(t, gamma, A @ gamma - b, privatizer)
                projected += int(float(torch.linalg.vector_norm(gamma)) >= self.proj_r * (1 - 1e-12))
        else:
            clip = float(state["clip"]) if self.adaptive else None
            gamma, _ = self.noisy_step(round, gamma, summed.stats["grad"], privatizer, clip)
            projected = int(float(torch.linalg.vector_norm(gamma)) >= self.proj_r * (1 - 1e-12))
        new = {"gamma": gamma}
        adaptive: dict[str, float] = {}
        if self.adaptive and clip is not None:
            fraction, next_clip = AdaptiveClip(self.clip_quantile, self.clip_lr).release(
                privatizer,
                summed.stats["below"],
                bound=clip,
                size=self.unit_divisor(round),  # public
                noise_multiplier=self.count_multiplier,
                name=f"step{round}.below",
                round=round,
                statistic=f"Σ_{self.unit_name} (1[‖A_u vec Γ − b_u‖ ≤ B_t] − 1/2)",
                units=f"cohort:{round % self.cycle}" if self.cycle > 1 else ALL_UNITS,
                params={"sampling": f"poisson q={self.sampling_rate}", "poisson_sample": f"step{round}"}
                if self.poisson
                else None,
                sampling_probability=self.sampling_rate if self.poisson and self.noise_multiplier > 0 else 1.0,
            )
            new["clip"] = torch.tensor(next_clip, dtype=torch.float64)
            sigma = (
                self.correlated.noise_std(self.round_multiplier, clip)
                if self.correlated is not None
                else self.round_multiplier * clip
            )
            adaptive = {"clip": clip, "noisy_fraction_below": fraction, "noise_std_sum": sigma}
        diagnostics = {
            "noise_std_sum": self.noise_std_sum,
            "noise_std_step": self.noise_std_step,
            "steps_at_radius_R": float(projected),
            "gamma_norm": float(torch.linalg.vector_norm(gamma)),
        }
        diagnostics.update(adaptive)
        if self.poisson:
            diagnostics.update(cohort_size("sampled_units", summed, privatizer, self.sampling_rate))
        return self._next_sample(new, privatizer), diagnostics
