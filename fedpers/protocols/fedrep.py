"""Private FedRep (Snedeker, Zhou and Bassily, "Private Model Personalization Revisited", ICML 2025).

Round 0 releases a private spectral initialisation (the statistic of AltMin's Algorithm 3,
over all of a user's sample pairs). Rounds 1..T: every user fits v_j by least squares on its
m samples with the broadcast U, and sends the gradient of its mean squared loss in U,

    G_j = (2/m) Σ_i (⟨Uᵀx_ij, v_j⟩ − y_ij) x_ij v_jᵀ,

clipped to Frobenius norm C. The server adds Gaussian noise to Σ_j G_j through the
:class:`~fedpers.privacy.Privatizer`, steps U ← U − η·(noisy sum)/n and re-orthonormalises.
Unlike the authors' script, the initialisation is private and accounted: a user is touched
by 1 + T Gaussian releases, composed with PLD.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dp_accounting
import torch

from fedpers import linalg
from fedpers.privacy import ALL_UNITS, Privatizer
from fedpers.privacy.adaptive_clip import (
    COUNT_BOUND,
    AdaptiveClip,
    SplitRoundBudget,
    below_statistic,
    share_multiplier,
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
LOCAL_RIDGE = 1e-6


@dataclass(frozen=True)
class FedRepProtocol(SplitRoundBudget, Protocol):
    """Public parameters of one (private) FedRep run: every user takes part in every round, a
    Poisson sample (``sampling_rate`` < 1), or the cohort of a public K-cycle (``cycle`` > 1)."""

    n_users: int
    dim: int
    rank: int
    samples_per_user: int
    rounds: int
    clip: float
    zeta: float
    learning_rate: float
    noise_multiplier: float
    dtype_name: str = "float64"
    sampling_rate: float = 1.0
    """q < 1: Poisson user sampling in rounds 1..T (the init uses every user); with ``cycle`` K > 1 too,
    round r samples only its cohort, at q (block-cyclic Poisson: amplified correlated noise)."""
    cycle: int = 1
    """K > 1: K fixed cohorts by id blocks (user i in cohort ⌊iK/n⌋); round r ≥ 1 uses cohort (r − 1) mod K."""
    correlated: CorrelatedNoise | None = None
    """Correlated noise across rounds 1..T (None: independent Gaussian noise per round)."""
    clip_quantile: float = 0.0
    """γ > 0: adaptive clipping (Andrew et al. 2021): ``clip`` is the first round's bound C_1; each
    round also releases the noisy count of its users with ‖G_j‖ ≤ C_t and moves the bound to
    C_{t+1} = C_t·exp(−η_C(b̄ − γ)), b̄ the noisy fraction of the public cohort size."""
    clip_lr: float = 0.2
    """η_C: the adaptive bound's geometric step."""
    count_share: float = 0.0
    """f: share of each participation's privacy (of μ², 1/z²) spent on the count (0 without adaptive clipping)."""

    name = "fedrep"

    @property
    def poisson(self) -> bool:
        return self.sampling_rate < 1.0

    @property
    def num_rounds(self) -> int:
        return self.rounds + 1

    @property
    def pairs(self) -> int:
        return self.samples_per_user // 2

    @property
    def init_bound(self) -> float:
        """Per-user Frobenius bound of the init statistic: pairs · ζ² (pairs = ⌊m/2⌋)."""
        return self.pairs * self.zeta**2

    def noise_std(self, bound: float) -> float:
        """σ = z·Δ/2 with Δ = 2·bound (replace-one)."""
        return self.noise_multiplier * bound if self.noise_multiplier > 0 else 0.0

    def round_noise_std(self, clip: float | None = None) -> float:
        """σ of a gradient round's noise at bound ``clip`` (C; of z before C⁻¹ when correlated)."""
        c = self.clip if clip is None else clip
        if self.correlated is not None:
            return self.correlated.noise_std(self.round_multiplier, c)
        return self.round_multiplier * c if self.round_multiplier > 0 else 0.0

    def releases_per_user(self) -> int:
        """Init + the rounds a user takes part in: ⌈T/K⌉ under a K-cycle (the largest cohort's count)."""
        return 1 + -(-self.rounds // self.cycle)

    def cohort_of(self, ids: Tensor) -> Tensor:
        """Public cohort of each user id under the K-cycle: ⌊id·K/n⌋ (blocks of consecutive ids)."""
        return torch.div(ids.to(torch.int64) * self.cycle, self.n_users, rounding_mode="floor")

    def cohort_range(self, cohort: int) -> tuple[int, int]:
        """[start, stop) of the ids in ``cohort`` (⌈kn/K⌉ .. ⌈(k+1)n/K⌉)."""
        n, K = self.n_users, self.cycle
        return -(-cohort * n // K), -(-(cohort + 1) * n // K)

    def round_cohort(self, round: int) -> int:
        return (round - 1) % self.cycle

    def cohort_size(self, round: int) -> int:
        """Public divisor of round ``round``: its cohort's size (n for K = 1)."""
        start, stop = self.cohort_range(self.round_cohort(round))
        return stop - start

    @staticmethod
    def user_event(
        noise_multiplier: float, releases: int, sampling_rate: float = 1.0, count_share: float = 0.0
    ) -> dp_accounting.DpEvent:
        """Init (every user) + ``releases − 1`` rounds, Poisson-sampled at ``sampling_rate`` < 1; with
        adaptive clipping (``count_share`` f > 0) a round is a gradient release of z/√(1 − f) and a
        count release of z/√f."""
        g = dp_accounting.GaussianDpEvent(noise_multiplier)
        if count_share > 0:
            per_round: list[dp_accounting.DpEvent] = [
                dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, 1.0 - count_share)),
                dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, count_share)),
            ]
        else:
            per_round = [g]
        if sampling_rate < 1.0:
            per_round = [dp_accounting.PoissonSampledDpEvent(sampling_rate, e) for e in per_round]
        return dp_accounting.ComposedDpEvent([g] + per_round * (releases - 1))

    def units_in_round(self, round: int, units: Units) -> int:
        if round >= 1 and self.cycle > 1:
            return int((self.cohort_of(units["ids"]) == self.round_cohort(round)).sum())
        return int(units["ids"].shape[0])

    def units_needed(self, round: int, broadcast: Mapping[str, Tensor]) -> tuple[Tensor | None, tuple[int, int] | None]:
        if round >= 1 and (self.cycle > 1 or self.poisson):
            # the round's block of ids (cycle), of which the server's sample (Poisson, sent with the broadcast)
            ids = torch.arange(*self.cohort_range(self.round_cohort(round)))
            if self.poisson:
                ids = ids[broadcast["sampled"].cpu()[ids] > 0]
            return ids, None
        return None, None

    # ----- protocol ------------------------------------------------------------------
    def node_side(self) -> NodeSide | str:
        """The init's W and each round's gradient sum G are Gaussian sums at z (independent noise, fixed clip)."""
        if self.adaptive:
            return f"{self.name} with adaptive clipping (its count releases; use --clip-rule fixed)"
        if self.correlated is not None:
            return f"{self.name} with correlated noise (its noise is correlated across steps; use --noise independent)"
        if self.poisson:  # the nodes draw the memberships
            return NodeSide(self.noise_multiplier, sampling_rate=self.sampling_rate)
        return NodeSide(self.noise_multiplier)

    def unit_keys(self) -> tuple[str, ...]:
        return ("x", "y")

    def initial_state(self) -> dict[str, Tensor]:
        return {}

    def broadcast(self, state: Mapping[str, Tensor], round: int) -> dict[str, Tensor]:
        if round == 0:
            return {}
        out = {"U": state["U"]}
        if self.poisson:
            # this round's membership, 1.0 for a sampled user (see docs: who may see it)
            out["sampled"] = state["sampled"]
        if self.adaptive:
            out["clip"] = state["clip"]  # C_t: public, made from released counts only
        return out

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        d, k = self.dim, self.rank
        if round == 0:
            return (StatSpec("W", (d, d), self.init_bound, symmetric=True),)
        if self.adaptive:
            # G_j/C_t clipped to norm 1, and 1[‖G_j‖ ≤ C_t] − 1/2: bounds that do not depend on the round's C_t
            return (StatSpec("G", (d, k), 1.0), StatSpec("below", (), COUNT_BOUND))
        return (StatSpec("G", (d, k), self.clip),)

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        x, y, ids = units["x"].to(self.dtype), units["y"].to(self.dtype), units["ids"]
        if round == 0:
            return Message({"W": self.init_statistic(x, y)}, int(ids.shape[0]))
        if self.poisson or self.cycle > 1:
            keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
            if self.poisson:
                keep &= broadcast["sampled"].to(ids.device)[ids] > 0
            if self.cycle > 1:
                keep &= self.cohort_of(ids) == self.round_cohort(round)
            if not all_take_part(keep):
                x, y = x[keep], y[keep]
        U = broadcast["U"].to(self.dtype)
        if self.adaptive:
            clip = float(broadcast["clip"])
            G, below = self.scaled_gradients(U, x, y, clip)
            return Message({"G": G.sum(0), "below": below_statistic(below, G.dtype)}, int(x.shape[0]))
        G = self.clipped_gradients(U, x, y).sum(0)
        return Message({"G": G}, int(x.shape[0]))

    def unit_statistics(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> UnitStatistics | None:
        """Each user's own W_j (round 0) or clipped G_j, batched: the ops :meth:`client_update` runs on one
        user, on every user of the batch at once; a user whose norms that path would not trust as computed
        (:func:`~fedpers.linalg.trusted_rows`) is left to be computed alone. Fixed clip only."""
        if self.adaptive:
            return None
        x, y, ids = units["x"].to(self.dtype), units["y"].to(self.dtype), units["ids"]
        everyone = torch.arange(int(ids.shape[0]), device=ids.device)
        if round == 0:
            p = self.pairs
            xs = x[:, : 2 * p]
            ok = linalg.trusted_rows(xs[:, 0::2]) & linalg.trusted_rows(xs[:, 1::2])
            W = linalg.pair_statistics(xs[ok], y[ok, : 2 * p], self.zeta)
            return UnitStatistics(ids[ok], {"W": W}, everyone[~ok])
        keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        if self.poisson:
            keep &= broadcast["sampled"].to(ids.device)[ids] > 0
        if self.cycle > 1:
            keep &= self.cohort_of(ids) == self.round_cohort(round)
        taking = everyone[keep]
        x, y, ids = x[taking], y[taking], ids[taking]
        g, v, sy = self._gradient_factors(broadcast["U"].to(self.dtype), x, y)
        ok = linalg.trusted_rows(g) & linalg.trusted_rows(v)  # their directions: the plain branch, as alone
        G, _ = self._clip_factors(g[ok], v[ok], sy[ok], self.clip)
        return UnitStatistics(ids[ok], {"G": G}, taking[~ok])

    def server_update(
        self, round: int, state: Mapping[str, Tensor], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        z = self.noise_multiplier
        if round == 0:
            M = privatizer.symmetric_gaussian_sum(
                summed.stats["W"],
                per_unit_bound=self.init_bound,
                noise_multiplier=z,
                name="init.W",
                round=0,
                units=ALL_UNITS,
                params={
                    "statistic": "W",
                    "pairs": self.pairs,
                    "zeta": self.zeta,
                    "formula": "bound ⌊m/2⌋·ζ², Δ = 2·bound",
                },
            )
            first: dict[str, Tensor] = {"U": linalg.top_eigenvectors(M, self.rank)}
            if self.adaptive:
                first["clip"] = torch.tensor(self.clip, dtype=torch.float64)
            return self.with_sample(first, privatizer), {"noise_std_W": self.noise_std(self.init_bound)}
        q = self.sampling_rate
        params: dict[str, Any] = {"statistic": "G", "clip": self.clip, "formula": "bound C (Frobenius), Δ = 2C"}
        if self.poisson:
            params["sampling"] = f"poisson q={q}"
        cohort = self.round_cohort(round)
        if self.cycle > 1:
            params["cohorts"] = f"cyclic K={self.cycle}, cohort {cohort}: ids ⌈kn/K⌉..⌈(k+1)n/K⌉"
        # adaptive: the sum of G_j/C_t (bound 1) is released and scaled back by the public C_t
        clip = float(state["clip"]) if self.adaptive else self.clip
        bound = 1.0 if self.adaptive else self.clip
        if self.adaptive:
            params.update(statistic="G/C_t", clip=clip, formula="bound 1 on G_j/C_t, Δ = 2; × C_t after noise")
        z = self.round_multiplier
        G = round_release(
            privatizer,
            summed.stats["G"],
            correlated=self.correlated,
            per_unit_bound=bound,
            noise_multiplier=z,
            stream="G",
            step=round - 1,
            name=f"round{round}.G",
            round=round,
            units=f"cohort:{cohort}" if self.cycle > 1 else ALL_UNITS,
            params=params,
            sampling_probability=q if z > 0 else 1.0,
        )
        # divide by the public expected cohort: q·(cohort size) (Poisson; the cohort is all n users without a
        # cycle) or the cycle's cohort size, never by a sampled count
        divisor = q * self.cohort_size(round) if self.poisson else self.cohort_size(round)
        if self.adaptive:
            G = G * clip
        U = state["U"].to(G.dtype) - self.learning_rate * G / divisor
        info = {
            "noise_std_G": self.round_noise_std(clip),
            "grad_norm": float(torch.linalg.matrix_norm(G)) / divisor,
        }
        new: dict[str, Tensor] = {"U": linalg.orthonormal_basis(U)}
        if self.adaptive:
            fraction, next_clip = AdaptiveClip(self.clip_quantile, self.clip_lr).release(
                privatizer,
                summed.stats["below"],
                bound=clip,
                size=divisor,  # the public cohort size
                noise_multiplier=self.count_multiplier,
                name=f"round{round}.below",
                round=round,
                statistic="Σ (1[‖G_j‖ ≤ C_t] − 1/2)",
                units=f"cohort:{cohort}" if self.cycle > 1 else ALL_UNITS,
                sampling_probability=q if z > 0 else 1.0,
            )
            new["clip"] = torch.tensor(next_clip, dtype=torch.float64)
            info["clip"], info["noisy_fraction_below"] = clip, fraction
        if self.poisson:
            info.update(cohort_size("sampled_users", summed, privatizer, self.sampling_rate))
        return self.with_sample(new, privatizer), info

    def with_sample(self, state: dict[str, Tensor], privatizer: Privatizer) -> dict[str, Tensor]:
        """Poisson: draw the next round's membership on the server (its private generator)."""
        if self.poisson:
            state["sampled"] = privatizer.poisson_sample(self.n_users, self.sampling_rate).to(torch.float64)
        return state

    # ----- the math ------------------------------------------------------------------
    def init_statistic(self, x: Tensor, y: Tensor) -> Tensor:
        """Σ_users Σ_pairs sym(x̂_a x̂_bᵀ clip(y_a) clip(y_b)) over the ⌊m/2⌋ disjoint sample pairs.

        x̂ = x/||x|| (0 for x = 0) is formed without overflow, so each pair's term has
        Frobenius norm ≤ ζ² for every finite input.
        """
        p = self.pairs
        return linalg.pair_statistic(x[:, : 2 * p], y[:, : 2 * p], self.zeta)

    def local_solve(self, U: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """v_j = argmin_v Σ_i (y_ij − ⟨Uᵀx_ij, v⟩)² (tiny ridge for safety), every user at once."""
        return linalg.batched_ridge_solve(x @ U, y, LOCAL_RIDGE)

    def scaled_gradients(self, U: Tensor, x: Tensor, y: Tensor, clip: float) -> tuple[Tensor, Tensor]:
        """(clip(G_j; C)/C per user, of norm ≤ 1; and whether ‖G_j‖ ≤ C), finite for every finite input."""
        G, log_norm = self._clipped(U, x, y, 1.0, math.log(clip))
        return G, log_norm <= math.log(clip)

    def clipped_gradients(self, U: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """clip(G_j; C) per user (users, d, k), finite and within C for every finite input.

        Each user's x and y are divided by powers of two s_x, s_y (exact) first; on the scaled
        data v' = v·s_x/s_y and G' = G/s_y², so G_j = Ĝ'·exp(log||G'|| + 2 log s_y) with the
        magnitude capped at C through logs: nothing overflows before the clip.
        """
        return self._clipped(U, x, y, self.clip)[0]

    def _clipped(self, U: Tensor, x: Tensor, y: Tensor, clip: float, log_scale: float = 0.0) -> tuple[Tensor, Tensor]:
        """clip(G_j·e^{−log_scale}; clip) per user and log‖G_j‖ (float64)."""
        n, _, d = x.shape
        k = U.shape[1]
        if n == 0:
            return x.new_zeros(0, d, k), torch.zeros(0, dtype=torch.float64, device=x.device)
        g, v, sy = self._gradient_factors(U, x, y)
        return self._clip_factors(g, v, sy, clip, log_scale)

    def _gradient_factors(self, U: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(g_j, v_j, s_y) with G_j = g_j v_jᵀ·s_y², on each user's data scaled by exact powers of two."""
        m = x.shape[1]
        sx, sy = linalg.pow2_scale(x, 2), linalg.pow2_scale(y, 1)
        xs, ys = x / sx[:, None, None], y / sy[:, None]
        v = self.local_solve(U, xs, ys)
        r = ((xs @ U) @ v.unsqueeze(-1)).squeeze(-1) - ys
        g = (2.0 / m) * (xs * r.unsqueeze(-1)).sum(1)  # (n, d): G'_j = g_j v_jᵀ
        return g, v, sy

    def _clip_factors(
        self, g: Tensor, v: Tensor, sy: Tensor, clip: float, log_scale: float = 0.0
    ) -> tuple[Tensor, Tensor]:
        """:meth:`_clipped` from :meth:`_gradient_factors`."""
        g_hat, log_g = linalg.directions(g)
        v_hat, log_v = linalg.directions(v)
        log_norm = log_g + log_v + 2 * sy.double().log()
        mag = linalg.clipped_magnitude(log_norm - log_scale, clip).to(g.dtype)
        return (g_hat * mag.unsqueeze(-1)).unsqueeze(-1) * v_hat.unsqueeze(-2), log_norm

    def gradients(self, U: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """Unclipped G_j (for tests and the non-private reading)."""
        v = self.local_solve(U, x, y)
        r = ((x @ U) @ v.unsqueeze(-1)).squeeze(-1) - y
        return (2.0 / x.shape[1]) * (x * r.unsqueeze(-1)).sum(1).unsqueeze(-1) * v.unsqueeze(-2)

    def refit(self, U: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """v_j refitted on a user's refit samples with the final U (local, never sent)."""
        return self.local_solve(U.to(x.dtype), x, y)


def default_zeta(rank: int, noise_std: float, c_zeta: float = 2.0) -> float:
    """ζ = c_ζ √(k + σ_F²), AltMin's label clip (public)."""
    return c_zeta * math.sqrt(rank + noise_std**2)
