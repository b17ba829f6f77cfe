"""NoisyGD for last-layer fine-tuning on (near-)neural-collapse features (docs/algorithms.md §3).

Privacy unit: one example (replace-one). Rounds 1..T are NoisyGD steps: the server
broadcasts W (K × q, zero at the start); every client returns the sum over its examples of
the per-example gradient clipped to G_c; the server adds N(0, (z·G_c)²) and steps
``W ← W − η (Σ_i clip(∇ℓ_i(W); G_c) + noise)``.

A remedy is an extra round 0 of the same protocol, released through the same Privatizer:
``center`` releases a DP mean of the features (each clipped to R) and every feature is
centred by it; ``pca`` releases a DP second moment Σ xxᵀ (symmetric Gaussian, each x
clipped to R) and every feature is projected on its top K−1 eigenvectors. The released
transform is public and applies to test features too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedpers import linalg
from fedpers.config import Neighbours, neighbours_of
from fedpers.configs.noisygd import Loss, Remedy
from fedpers.privacy import ALL_UNITS, Privatizer
from fedpers.privacy.adaptive_clip import COUNT_BOUND, AdaptiveClip
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


# ----- the math ---------------------------------------------------------------------------
def clipped_gradient_sum(W: Tensor, x: Tensor, y: Tensor, clip: float, loss: Loss) -> tuple[Tensor, Tensor]:
    """Σ_i clip(r_i x_iᵀ; G) without forming per-example gradients (||r xᵀ||_F = ||r||·||x||); and how
    many were clipped (a 0-dim int64 where the sum is: nothing is read on the host).

    Each term is m_i r̂_i x̂_iᵀ with m_i = min(||r_i||·||x_i||, G) from log-norms, and x is
    scaled per example by an exact power of two before W x, so every finite input gives a
    finite term of norm ≤ G (an overflowing logit only saturates the softmax).
    """
    r_scaled, x_hat, log_norm = _gradient_factors(W, x, y, clip, loss)
    return r_scaled.transpose(0, 1) @ x_hat, (log_norm > math.log(clip)).sum()


def _gradient_factors(W: Tensor, x: Tensor, y: Tensor, clip: float, loss: Loss) -> tuple[Tensor, Tensor, Tensor]:
    """(m_i r̂_i, x̂_i, log‖r_i x_iᵀ‖): example i's clipped gradient is the outer product of the first two."""
    return _factors(*_residuals(W, x, y, loss), x, clip)


def _residuals(W: Tensor, x: Tensor, y: Tensor, loss: Loss) -> tuple[Tensor, Tensor]:
    """(r_i, log s_i): example i's residual is s_i·r_i (x is scaled per example by an exact power of two before
    W x); each row's bits are the same alone or in a batch."""
    scale = linalg.pow2_scale(x)
    t = linalg.row_products(x / scale.unsqueeze(-1), W)
    onehot = torch.nn.functional.one_hot(y, W.shape[0]).to(t.dtype)
    if loss is Loss.CE:
        shifted = (t - t.amax(-1, keepdim=True)) * scale.unsqueeze(-1)
        return torch.softmax(shifted, dim=-1) - onehot, torch.zeros_like(scale, dtype=torch.float64)
    return t - onehot / scale.unsqueeze(-1), scale.double().log()


def _factors(r: Tensor, log_scale: Tensor, x: Tensor, clip: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_gradient_factors` from the residuals :func:`_residuals` gave."""
    r_hat, log_r = linalg.directions(r)
    x_hat, log_x = linalg.directions(x)
    log_norm = log_r + log_scale + log_x
    m = linalg.clipped_magnitude(log_norm, clip).to(x.dtype)
    return r_hat * m.unsqueeze(-1), x_hat, log_norm


@dataclass(frozen=True)
class NoisyGDProtocol(Protocol):
    """Public parameters of one NoisyGD run (all data-independent; n is public under replace-one)."""

    classes: int
    feature_dim: int
    examples: int
    steps: int
    lr: float
    grad_clip: float
    noise_multiplier: float
    remedy: Remedy = Remedy.NONE
    feature_bound: float = 1.0
    remedy_noise_multiplier: float = 0.0
    loss: Loss = Loss.CE
    dtype_name: str = "float32"
    cycle: int = 1
    """K > 1: K fixed cohorts of examples by id blocks (example i in ⌊iK/n⌋); step s (0-based) uses cohort s mod K."""
    sampling_rate: float = 1.0
    """q < 1: each step includes every example of its cohort (all examples without a cycle) independently
    with probability q, drawn on the server from the Privatizer's sampling generator; the noisy sum is
    scaled by the public n/(q·|cohort|), never by a sampled count. The remedy round uses every example."""
    correlated: CorrelatedNoise | None = None
    """Correlated noise across the T steps (None: independent Gaussian noise per step)."""
    clip_quantile: float = 0.0
    """γ > 0: adaptive clipping (Andrew et al. 2021), ``grad_clip`` is the first step's bound (docs/algorithms.md §6)."""
    clip_lr: float = 0.2
    count_share: float = 0.0
    """f: share of each step's μ² spent on the count of examples under the bound."""

    name = "noisygd"

    @property
    def remedy_rounds(self) -> int:
        return 0 if self.remedy is Remedy.NONE else 1

    @property
    def num_rounds(self) -> int:
        return self.remedy_rounds + self.steps

    @property
    def model_dim(self) -> int:
        return self.classes - 1 if self.remedy is Remedy.PCA else self.feature_dim

    def noise_std(self) -> float:
        """σ of a step's noise (of z before C⁻¹ when correlated)."""
        if self.correlated is not None:
            return self.correlated.noise_std(self.noise_multiplier, self.grad_clip)
        return self.noise_multiplier * self.grad_clip

    # ----- cyclic cohorts (public) ------------------------------------------------------------
    def cohort_of(self, ids: Tensor) -> Tensor:
        return torch.div(ids.to(torch.int64) * self.cycle, self.examples, rounding_mode="floor")

    def cohort_range(self, cohort: int) -> tuple[int, int]:
        """[start, stop) of the example ids in ``cohort`` (⌈kn/K⌉ .. ⌈(k+1)n/K⌉)."""
        n, K = self.examples, self.cycle
        return -(-cohort * n // K), -(-(cohort + 1) * n // K)

    def step_cohort(self, round: int) -> int:
        return (round - self.remedy_rounds) % self.cycle

    def participations(self) -> int:
        """Steps an example takes part in: ⌈T/K⌉ (the largest cohort's count)."""
        return -(-self.steps // self.cycle)

    @property
    def poisson(self) -> bool:
        return self.sampling_rate < 1.0

    def server_start(self, state: dict[str, Tensor], privatizer: Privatizer) -> dict[str, Tensor]:
        return self._next_sample(state, privatizer)

    def _next_sample(self, state: dict[str, Tensor], privatizer: Privatizer) -> dict[str, Tensor]:
        """Poisson: the next step's members, drawn on the server (its private sampling generator)."""
        if self.poisson:
            state["sampled"] = privatizer.poisson_sample(self.examples, self.sampling_rate).to(torch.float64)
        return state

    def units_in_round(self, round: int, units: Units) -> int:
        if round >= self.remedy_rounds and self.cycle > 1:
            return int((self.cohort_of(units["ids"]) == self.step_cohort(round)).sum())
        return int(units["ids"].shape[0])

    def units_needed(self, round: int, broadcast: Mapping[str, Tensor]) -> tuple[Tensor | None, tuple[int, int] | None]:
        if round >= self.remedy_rounds and (self.cycle > 1 or self.poisson):
            # the round's block of ids (cycle), of which the server's sample (Poisson, sent with the broadcast)
            ids = torch.arange(*self.cohort_range(self.step_cohort(round)))
            if self.poisson:
                ids = ids[broadcast["sampled"].cpu()[ids] > 0]
            return ids, None
        return None, None

    def remedy_noise_std(self, neighbours: Neighbours | str = Neighbours.REPLACE_ONE) -> float:
        """σ = z·Δ/κ: replace-one Δ = 2R for the mean, √2·R² for the PSD second moment; add-remove Δ = R, R²."""
        if self.remedy is Remedy.PCA and neighbours_of(neighbours) is Neighbours.REPLACE_ONE:
            return self.remedy_noise_multiplier * self.feature_bound**2 / math.sqrt(2.0)
        return self.remedy_noise_multiplier * self.feature_bound ** (2 if self.remedy is Remedy.PCA else 1)

    # ----- feature transform (public once released) -----------------------------------------
    def transform(self, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """The released remedy applied to features: x − μ̂ (center), x P̂ (pca), or x."""
        if self.remedy is Remedy.CENTER:
            return x - state["mu"].to(x.device, x.dtype)
        if self.remedy is Remedy.PCA:
            return x @ state["P"].to(x.device, x.dtype)
        return x

    def predict(self, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
        W = state["W"].to(x.device, self.dtype)
        return (self.transform(state, x.to(self.dtype)) @ W.transpose(0, 1)).argmax(-1)

    # ----- protocol ---------------------------------------------------------------------------
    def node_side(self) -> NodeSide | str:
        """Each step's gradient sum is a Gaussian sum at z (independent noise, fixed clip, no remedy)."""
        if self.adaptive:
            return f"{self.name} with adaptive clipping (its count releases; use --clip-rule fixed)"
        if self.correlated is not None:
            return f"{self.name} with correlated noise (its noise is correlated across steps; use --noise independent)"
        if self.remedy_noise_multiplier > 0:
            return f"{self.name} with a remedy (its feature releases take a second noise multiplier; use --remedy none)"
        return NodeSide(self.noise_multiplier, sampling_rate=self.sampling_rate if self.poisson else 1.0)

    def unit_keys(self) -> tuple[str, ...]:
        return ("x", "y")

    def initial_state(self) -> dict[str, Tensor]:
        state = {"W": torch.zeros(self.classes, self.model_dim, dtype=self.dtype)}
        if self.adaptive:
            state["clip"] = torch.tensor(self.grad_clip, dtype=torch.float64)
        return state

    @property
    def adaptive(self) -> bool:
        return self.clip_quantile > 0

    @property
    def count_multiplier(self) -> float:
        """z_c such that the step's gradient (z) and count (z_c) releases split μ² as 1 − f : f."""
        return self.noise_multiplier * math.sqrt((1 - self.count_share) / self.count_share)

    def broadcast(self, state: Mapping[str, Tensor], round: int) -> dict[str, Tensor]:
        if round < self.remedy_rounds:
            return {}
        # "sampled": this step's membership under Poisson sampling (see docs/fedrep.md: who may see it)
        return {k: v for k, v in state.items() if k in ("W", "mu", "P", "clip", "sampled")}

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        if round < self.remedy_rounds:
            if self.remedy is Remedy.CENTER:
                return (StatSpec("feature_sum", (self.feature_dim,), self.feature_bound),)
            return (
                StatSpec("second_moment", (self.feature_dim, self.feature_dim), self.feature_bound**2, symmetric=True),
            )
        if self.adaptive:
            # Σ clip(∇ℓ_i; C_t)/C_t and Σ (1[‖∇ℓ_i‖ ≤ C_t] − 1/2): bounds that do not depend on C_t
            return (StatSpec("grad", (self.classes, self.model_dim), 1.0), StatSpec("below", (), COUNT_BOUND))
        return (StatSpec("grad", (self.classes, self.model_dim), self.grad_clip),)

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        x, y = units["x"].to(self.dtype), units["y"].to(torch.int64)
        n = int(x.shape[0])
        if round < self.remedy_rounds:
            xc = linalg.clip_vectors(x, self.feature_bound)
            if self.remedy is Remedy.CENTER:
                return Message({"feature_sum": xc.sum(0)}, n)
            return Message({"second_moment": linalg.sym(xc.transpose(0, 1) @ xc)}, n)  # Σ x xᵀ: PSD per unit
        if self.cycle > 1 or self.poisson:
            ids = units["ids"].to(x.device)
            keep = torch.ones(ids.shape[0], dtype=torch.bool, device=x.device)
            if self.poisson:
                keep &= broadcast["sampled"].to(x.device)[ids] > 0
            if self.cycle > 1:
                keep &= self.cohort_of(ids) == self.step_cohort(round)
            if not all_take_part(keep):
                x, y = x[keep], y[keep]
                n = int(x.shape[0])
        clip = float(broadcast["clip"]) if self.adaptive else self.grad_clip
        grad, clipped = clipped_gradient_sum(
            broadcast["W"].to(x.device, self.dtype), self.transform(broadcast, x), y, clip, self.loss
        )
        if self.adaptive:
            # (n − clipped) − n/2 in float64 (exact: small integers), then the dtype: the value the host formed
            below = ((n - clipped).double() - n / 2).to(self.dtype)
            return Message({"grad": grad / clip, "below": below}, n)
        return Message({"grad": grad}, n)

    def unit_statistics(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> UnitStatistics | None:
        """Each example's own clipped gradient, batched: the ops :meth:`client_update` runs on one example,
        on every example of the batch at once, grouped by which of its residual's and features' norms are trusted
        as computed (each group takes the branches its examples take alone). Fixed clip, no remedy (a remedy
        is not node-side)."""
        if self.adaptive or self.remedy is not Remedy.NONE:
            return None  # a remedy's transform is a matrix product whose bits depend on the batch
        x, y, ids = units["x"].to(self.dtype), units["y"].to(torch.int64), units["ids"].to(units["x"].device)
        keep = torch.ones(ids.shape[0], dtype=torch.bool, device=x.device)
        if self.poisson:
            keep &= broadcast["sampled"].to(x.device)[ids] > 0
        if self.cycle > 1:
            keep &= self.cohort_of(ids) == self.step_cohort(round)
        taking = keep.nonzero().squeeze(1)
        x, y, ids = x[taking], y[taking], ids[taking]
        W = broadcast["W"].to(x.device, self.dtype)
        xt = self.transform(broadcast, x)
        r, log_scale = _residuals(W, xt, y, self.loss)
        # directions() takes its plain branch for a batch only if every row's norm is trusted, and each
        # example alone takes the branch its own rows decide: so the examples are computed in the four
        # groups of (residual trusted, features trusted), each group's batch taking the branches each of its
        # examples takes alone (a saturated softmax's residual below 2⁻⁴⁰ is common late in training)
        r_ok, x_ok = linalg.trusted_rows(r), linalg.trusted_rows(xt)
        grad = xt.new_empty(xt.shape[0], W.shape[0], xt.shape[1])
        for group in (r_ok & x_ok, ~r_ok & x_ok, r_ok & ~x_ok, ~r_ok & ~x_ok):
            rows = group.nonzero().squeeze(1)
            if rows.numel():
                r_scaled, x_hat, _ = _factors(r[rows], log_scale[rows], xt[rows], self.grad_clip)
                grad[rows] = r_scaled.unsqueeze(-1) * x_hat.unsqueeze(-2)  # a one-example sum: the outer product
        return UnitStatistics(ids, {"grad": grad}, taking[:0])

    def server_update(
        self, round: int, state: Mapping[str, Tensor], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        new: dict[str, Any] = dict(state)
        if round < self.remedy_rounds:
            if self.remedy is Remedy.CENTER:
                total = privatizer.gaussian_sum(
                    summed.stats["feature_sum"],
                    per_unit_bound=self.feature_bound,
                    noise_multiplier=self.remedy_noise_multiplier,
                    name="remedy.mean",
                    round=round,
                    params={"statistic": "Σ x", "R": self.feature_bound, "formula": "bound R, Δ = 2·bound"},
                )
                new["mu"] = total / self.examples  # the declared n (public): under add-remove not the data's count
                return new, {"noise_std_mean": self.remedy_noise_std(privatizer.neighbours)}
            S = privatizer.symmetric_gaussian_sum(
                summed.stats["second_moment"],
                per_unit_bound=self.feature_bound**2,
                noise_multiplier=self.remedy_noise_multiplier,
                name="remedy.pca",
                round=round,
                psd_units=True,
                params={
                    "statistic": "Σ x xᵀ",
                    "R": self.feature_bound,
                    "formula": "bound R², Δ = √2·bound (PSD per example)",
                },
            )
            new["P"] = linalg.top_eigenvectors(S.double(), self.classes - 1).to(self.dtype)
            return new, {"noise_std_second_moment": self.remedy_noise_std(privatizer.neighbours)}
        step = round - self.remedy_rounds + 1
        params: dict[str, Any] = {
            "statistic": "Σ clip(∇ℓ_i; G_c)",
            "G_c": self.grad_clip,
            "formula": "bound G_c, Δ = 2·bound",
        }
        cohort = self.step_cohort(round)
        if self.cycle > 1:
            params["cohorts"] = f"cyclic K={self.cycle}, cohort {cohort}: ids ⌈kn/K⌉..⌈(k+1)n/K⌉"
        if self.poisson:
            params["sampling"] = f"poisson q={self.sampling_rate}"
        clip = float(state["clip"]) if self.adaptive else self.grad_clip
        bound = 1.0 if self.adaptive else self.grad_clip
        if self.adaptive:
            params.update(statistic="Σ clip(∇ℓ_i; C_t)/C_t", C_t=clip, formula="bound 1, Δ = 2; × C_t after noise")
        g = round_release(
            privatizer,
            summed.stats["grad"],
            correlated=self.correlated,
            per_unit_bound=bound,
            noise_multiplier=self.noise_multiplier,
            stream="grad",
            step=step - 1,
            name=f"step{step}.grad",
            round=round,
            units=f"cohort:{cohort}" if self.cycle > 1 else ALL_UNITS,
            params=params,
            sampling_probability=self.sampling_rate if self.poisson and self.noise_multiplier > 0 else 1.0,
        )
        start, stop = self.cohort_range(cohort)
        if self.adaptive:
            g = g * clip
            _, next_clip = AdaptiveClip(self.clip_quantile, self.clip_lr).release(
                privatizer,
                summed.stats["below"],
                bound=clip,
                size=stop - start,  # public
                noise_multiplier=self.count_multiplier,
                name=f"step{step}.below",
                round=round,
                statistic="Σ (1[‖∇ℓ_i‖ ≤ C_t] − 1/2)",
                units=f"cohort:{cohort}" if self.cycle > 1 else ALL_UNITS,
            )
            new["clip"] = torch.tensor(next_clip, dtype=torch.float64)
        if self.cycle > 1 or self.poisson:
            # the cohort's (sampled) sum scaled to the full data by public sizes: n / (q·|cohort|)
            g = g * (self.examples / (self.sampling_rate * (stop - start)))
        new["W"] = state["W"].to(g.device) - self.lr * g  # W lives where the sums are (the run's device)
        # Only post-processed (noisy) quantities in the diagnostics: they are written to disk.
        info = {"noise_std_grad": self.noise_std(), "noisy_grad_norm": float(torch.linalg.vector_norm(g.double()))}
        if self.poisson:
            info.update(cohort_size("sampled_examples", summed, privatizer, self.sampling_rate))
        return self._next_sample(new, privatizer), info
