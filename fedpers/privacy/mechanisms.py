"""Noise mechanisms. The only place in fedpers that adds noise.

A :class:`Privatizer` lives on the server: it owns the DP-noise generator (clients never
see its seed) and the ledger. Every method validates its arguments, draws the noise,
and appends one :class:`~fedpers.privacy.ledger.Release` before returning the release.

Conventions: ``per_unit_bound`` is the norm bound (L2, Frobenius for matrices) of one
unit's contribution to the sum. The Privatizer's neighbouring relation (``neighbours``, the run's
declared one) turns it into the L2 sensitivity Δ: replace-one, Δ = ``2 * per_unit_bound`` — or
``√2 * per_unit_bound`` when every unit's contribution is a PSD matrix and the release is not
sampled (``psd_units=True``; proof at :meth:`Privatizer.symmetric_gaussian_sum`); add-remove,
Δ = ``per_unit_bound`` (a unit's whole contribution is its distance from absent). ``noise_multiplier``
z is dp-accounting's convention: the release is ``GaussianDpEvent(z)`` under the relation (privacy
loss μ = κ/z with κ = 2 replace-one, 1 add-remove) and ``noise_std`` σ = z·Δ/κ, which is
z·per_unit_bound in the general case. Every release names its relation in the ledger.

Every noise draw meets its value in :meth:`Privatizer._perturb` (Gaussian releases),
:meth:`Privatizer._select` (exponential mechanism) or :meth:`Privatizer._sample_covariance`;
the privacy tests override these to observe the exact pre-noise value of each release.

With ``secure=False`` the generators are torch's (not cryptographic) and seeded: a run is
reproducible, and its noise is public to whoever holds its seed — fine for simulation, not
for deployment against a real adversary. ``secure=True`` draws every noise value from OS
entropy through floating-point-safe samplers (:mod:`fedpers.privacy.secure`); the seed is
then unused and nothing a run writes can recompute its noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
import torch

from fedpers import linalg
from fedpers.config import Neighbours, PreconditionFailed, neighbours_of
from fedpers.configs.dpattention import (
    Condition,
    DpCovarianceParams,
    dp_covariance_min_k,  # noqa: F401  (re-exported: the mechanism's parameters live in the configs layer)
    dp_covariance_rho,  # noqa: F401
    public_conditions,
)
from fedpers.privacy import correlated as correlated_module
from fedpers.privacy import secure as secure_module
from fedpers.privacy.ledger import ALL_UNITS, EpsilonDeltaDpEvent, Ledger, PureDpEvent, Release

Tensor = torch.Tensor


# ----- DPCovariance preconditions (dp-attention-computation, docs/algorithms.md §4) -----
def dp_covariance_conditions(params: DpCovarianceParams, A: Tensor) -> tuple[Condition, ...]:
    """Every precondition of Theorem 3.1: those the public parameters decide
    (:func:`fedpers.configs.dpattention.public_conditions`), then the two decided on the summed A.

    Column norms ≤ α is not re-checked here: clients clip every column to α (the protocol's
    per-unit bound), which makes it hold by construction.
    """
    p = params
    lam_min = float(torch.linalg.eigvalsh(A.double()).min())
    a_inf = float(A.abs().max())
    return (
        *public_conditions(p),
        Condition("eta_good", lam_min >= p.eta, lam_min, p.eta, "XXᵀ ⪰ ηI (λ_min(A) ≥ η)"),
        Condition("a_inf_le_r", a_inf <= p.r, a_inf, p.r, "||A||_∞ = max|A_ij| ≤ r"),
    )


@dataclass(frozen=True)
class CovarianceRelease:
    """B and the preconditions it was released under (every one holds: a release is never made otherwise)."""

    B: Tensor
    conditions: tuple[Condition, ...]


def psd_sensitivity(
    per_unit_bound: float, sampling_probability: float = 1.0, neighbours: Neighbours | str = Neighbours.REPLACE_ONE
) -> float:
    """Δ of a sum of PSD unit contributions of norm ≤ bound: replace-one √2·bound, or 2·bound when
    Poisson-sampled (proof at :meth:`Privatizer.symmetric_gaussian_sum`); add-remove bound (a PSD
    unit is its full norm from absent: nothing to tighten)."""
    relation = neighbours_of(neighbours)
    if relation is Neighbours.ADD_REMOVE:
        return float(per_unit_bound)
    return (math.sqrt(2.0) if sampling_probability >= 1.0 else 2.0) * float(per_unit_bound)


def check_psd_sum(value: Tensor, name: str) -> None:
    """Refuse a value declared a sum of PSD contributions that is not PSD (beyond rounding)."""
    v = value.detach().to("cpu", torch.float64)
    v = (v + v.transpose(0, 1)) / 2
    trace = float(torch.diagonal(v).sum())
    slack = math.sqrt(torch.finfo(value.dtype).eps) * max(trace, 0.0) + 1e-300
    if trace < -slack or int(torch.linalg.cholesky_ex(v + slack * torch.eye(v.shape[0], dtype=v.dtype)).info) != 0:
        lam = float(torch.linalg.eigvalsh(v).min())
        raise ValueError(
            f"release {name!r}: psd_units declared but the summed statistic is not positive semi-definite "
            f"(λ_min = {lam:.4g}, trace {trace:.4g}); the √2 PSD bound applies only to sums of PSD contributions"
        )


class Privatizer:
    """Server-side mechanisms with a private generator and the ledger they append to."""

    knows_cohort: bool = True
    """The server drew each round's Poisson cohort itself and holds its size |S| (central DP: the trusted
    curator's own records may show it); False where the nodes drew it and |S| is not released."""

    def __init__(
        self,
        seed: int,
        ledger: Ledger | None = None,
        *,
        secure: bool = False,
        neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
    ) -> None:
        self.secure = bool(secure)
        self.neighbours = neighbours_of(neighbours)
        """The run's declared neighbouring relation: every sensitivity here is Δ under it, every release names it."""
        self.generator = torch.Generator(device="cpu").manual_seed(
            secure_module.os_seed() if self.secure else int(seed)
        )
        # Poisson memberships: their own stream, so they do not shift the noise draws (and vice versa)
        self.sampling_generator = torch.Generator(device="cpu").manual_seed(
            secure_module.os_seed() if self.secure else (int(seed) ^ 0x5DEECE66D) % 2**63
        )
        self.ledger = ledger if ledger is not None else Ledger()
        self.recurrences: dict[str, correlated_module.NoiseRecurrence] = {}
        """Correlated-noise streams by name: the b − 1 last noise vectors of each (never released)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the same random streams: the generators' states
        (none with ``secure``: they must stay unknown) and the number of releases so far."""
        out: dict[str, Any] = {"releases": len(self.ledger), "secure": self.secure}
        if not self.secure:
            out["generator"] = self.generator.get_state()
            out["sampling_generator"] = self.sampling_generator.get_state()
        if self.recurrences:
            out["recurrences"] = {
                k: {
                    "coefficients": list(r.coefficients),
                    "step": r.step,
                    "history": [h.clone() for h in r.history],
                    "buf_decay": list(r.buf_decay),
                    "output_scale": list(r.output_scale),
                }
                for k, r in self.recurrences.items()
            }
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if bool(state.get("secure")) != self.secure:
            raise ValueError(
                f"secure_noise: the checkpoint was written with secure_noise={bool(state.get('secure'))}, this run has {self.secure}"
            )
        if not self.secure:
            self.generator.set_state(state["generator"])
            self.sampling_generator.set_state(state["sampling_generator"])
        self.recurrences = {
            k: correlated_module.NoiseRecurrence(
                tuple(float(c) for c in r["coefficients"]),
                int(r["step"]),
                [h.to("cpu", torch.float64) for h in r["history"]],
                tuple(float(c) for c in r.get("buf_decay", [])),
                tuple(float(c) for c in r.get("output_scale", [])),
            )
            for k, r in state.get("recurrences", {}).items()
        }

    def _normal(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        # Drawn on the CPU in float64 so a run reproduces across devices and dtypes.
        z = torch.randn(shape, generator=self.generator, dtype=torch.float64)
        return z.to(device=like.device, dtype=like.dtype)

    @staticmethod
    def _check(value: Tensor, per_unit_bound: float, noise_multiplier: float, name: str) -> None:
        if not torch.isfinite(value).all():
            raise ValueError(f"release {name!r}: the summed statistic has non-finite values")
        if not (per_unit_bound > 0 and math.isfinite(per_unit_bound)) and noise_multiplier > 0:
            raise ValueError(
                f"release {name!r}: per_unit_bound must be finite and > 0 to add calibrated noise, got {per_unit_bound}"
            )
        if not noise_multiplier >= 0 or math.isinf(noise_multiplier):
            raise ValueError(f"release {name!r}: noise_multiplier must be in [0, inf), got {noise_multiplier}")

    def _record(
        self,
        round: int,
        name: str,
        mechanism: str,
        bound: float,
        z: float,
        units: str,
        sensitivity: float | None = None,
        params: dict[str, Any] | None = None,
        sampling_probability: float = 1.0,
    ) -> Release:
        factor = self.neighbours.sensitivity_factor
        sensitivity = factor * float(bound) if sensitivity is None else float(sensitivity)
        noise_std = z * sensitivity / factor if z > 0 else 0.0
        event = dp_accounting.GaussianDpEvent(z) if z > 0 else dp_accounting.NonPrivateDpEvent()
        if z > 0 and sampling_probability < 1.0:
            # units entered independently with this probability (Poisson), from a generator they cannot predict
            event = dp_accounting.PoissonSampledDpEvent(float(sampling_probability), event)
        release = Release(
            round,
            name,
            mechanism,
            float(bound),
            sensitivity,
            float(noise_std),
            units,
            event,
            dict(params or {}),
            self.neighbours.value,
        )
        self.ledger.append(release)
        return release

    def _perturb(self, release: Release, value: Tensor, noise: Callable[[], Tensor]) -> Tensor:
        """The one place a Gaussian release's value meets its noise: value + σ·noise()."""
        if release.noise_std == 0:
            return value.clone()
        if self.secure:
            if release.mechanism == "symmetric_gaussian":
                return secure_module.symmetric_gaussian(value, release.noise_std)
            return secure_module.gaussian(value, release.noise_std)
        return value + release.noise_std * noise()

    def gaussian_sum(
        self,
        value: Tensor,
        *,
        per_unit_bound: float,
        noise_multiplier: float,
        name: str,
        round: int,
        units: str = ALL_UNITS,
        params: dict[str, Any] | None = None,
        sampling_probability: float = 1.0,
    ) -> Tensor:
        """Sum of clipped unit contributions + N(0, (z·bound)² I). ``sampling_probability`` < 1:
        each unit was included independently with that probability (recorded as a
        ``PoissonSampledDpEvent`` for the accountant)."""
        self._check(value, per_unit_bound, noise_multiplier, name)
        if not 0.0 < sampling_probability <= 1.0:
            raise ValueError(f"release {name!r}: sampling_probability must be in (0, 1], got {sampling_probability}")
        release = self._record(
            round,
            name,
            "gaussian",
            per_unit_bound,
            noise_multiplier,
            units,
            params=params,
            sampling_probability=sampling_probability,
        )
        return self._perturb(release, value, lambda: self._normal(tuple(value.shape), value))

    def correlated_gaussian_sum(
        self,
        value: Tensor,
        *,
        per_unit_bound: float,
        noise_multiplier: float,
        noise: correlated_module.CorrelatedNoise,
        stream: str,
        step: int,
        name: str,
        round: int,
        params: dict[str, Any] | None = None,
    ) -> Tensor:
        """Round ``step`` (0-based) of T of a correlated stream: value + σ·w_step, w = C⁻¹z, z ~ N(0, I).

        The T releases of a stream are one Gaussian mechanism on Cx with Δ = 2·bound·s (s: the
        participation's sensitivity per unit bound) and σ = z·bound·s/√P (P: max participations),
        i.e. joint multiplier z/√P (:class:`~fedpers.privacy.correlated.CorrelatedNoise`). Each
        round is recorded with units ``all``, sensitivity Δ/√T and the same σ: the T records
        compose to exactly the joint mechanism in every accountant (Gaussian μ² add). One band
        (C = I) draws exactly ``gaussian_sum``'s noise. The steps must come in order.

        Amplified (``noise.sampling_rate`` < 1: b groups sampled in turn, b-banded C): each round is
        recorded as a Poisson-sampled Gaussian of the round's group (units ``cohort:g``), sensitivity
        κ·bound·(max column norm) and the same σ = z·bound·(max column norm); a group's ⌈T/b⌉ records
        compose to jax_privacy's ``amplified_bandmf_event`` (Choquette-Choo et al. 2023, Theorem 4).

        ``secure``: round t's noise σ·w_t is σ·z_t plus σ times the recurrence's offset (a function of
        the earlier rounds' noise only). The floating-point-safe sampler draws σ·z_t from OS entropy
        around value + σ·offset, and w_t is read back as (release − value)/σ: the recurrence then holds
        the noise actually released, which exists only in this process's memory (and the server's
        checkpoint), never in anything a seed could recompute.
        """
        self._check(value, per_unit_bound, noise_multiplier, name)
        T = noise.horizon
        rec = self.recurrences.setdefault(stream, noise.strategy.recurrence())
        if rec.spec() != noise.strategy.recurrence().spec() or rec.step != step or not 0 <= step < T:
            raise ValueError(
                f"release {name!r}: correlated stream {stream!r} expects step {rec.step} of {T} "
                f"with its own strategy; got step {step}"
            )
        sigma = noise.noise_std(noise_multiplier, per_unit_bound)
        factor = self.neighbours.sensitivity_factor
        joint = factor * float(per_unit_bound) * noise.sensitivity.value
        if noise.amplified:
            # one participation moves only its own columns' rows of Cx (b bands, ≥ b rounds apart): each round
            # is a Poisson-sampled Gaussian on its group, of multiplier σ/(bound·max column norm)
            z_round = factor * sigma / joint if sigma > 0 else 0.0
            event: dp_accounting.DpEvent = (
                dp_accounting.PoissonSampledDpEvent(noise.sampling_rate, dp_accounting.GaussianDpEvent(z_round))
                if sigma > 0
                else dp_accounting.NonPrivateDpEvent()
            )
            sensitivity, units = joint, f"cohort:{noise.group(step)}" if noise.cycle > 1 else ALL_UNITS
            accounting = (
                "amplified banded MF (Choquette-Choo et al. 2023, Theorem 4): per group ⌈T/b⌉ Poisson-sampled "
                "Gaussians, Δ = κ·bound·(max column norm), σ = z·bound·(max column norm)"
            )
        else:
            z_round = factor * sigma * math.sqrt(T) / joint if sigma > 0 else 0.0
            event = dp_accounting.GaussianDpEvent(z_round) if sigma > 0 else dp_accounting.NonPrivateDpEvent()
            sensitivity, units = joint / math.sqrt(T), ALL_UNITS
            accounting = "joint Gaussian on Cx (Δ = κ·bound·s, σ = z·bound·s/√P) split evenly over T rounds"
        release = Release(
            round,
            name,
            "correlated_gaussian",
            float(per_unit_bound),
            sensitivity,
            float(sigma),
            units,
            event,
            {
                **(params or {}),
                **noise.params(),
                "step": step,
                "joint_sensitivity": joint,
                "accounting": accounting,
            },
            self.neighbours.value,
        )
        self.ledger.append(release)

        if self.secure:
            if sigma == 0:
                rec.push(torch.zeros(tuple(value.shape), dtype=torch.float64))
                return value.clone()
            shift = rec.offset(tuple(value.shape)).to(device=value.device, dtype=torch.float64)
            base = value.to(torch.float64) + sigma * shift
            out = self._perturb(release, base.to(value.dtype), lambda: torch.zeros_like(base))
            rec.push((out.to(torch.float64) - value.to(torch.float64)) / sigma)
            return out
        # the recurrence advances here, whatever _perturb does with the draw (the stream stays in step)
        z = (
            torch.randn(tuple(value.shape), generator=self.generator, dtype=torch.float64)
            if sigma > 0
            else torch.zeros(tuple(value.shape), dtype=torch.float64)
        )
        w = rec.next(z).to(device=value.device, dtype=value.dtype)
        return self._perturb(release, value, lambda: w)

    def poisson_sample(self, n: int, q: float) -> Tensor:
        """Bool mask of n units, each included independently with probability q, drawn from the
        server's private generator (OS entropy with ``secure``), so clients cannot predict it."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sampling rate q must be in (0, 1], got {q}")
        return torch.rand(n, generator=self.sampling_generator, dtype=torch.float64) < q

    def gaussian_sum_batched(
        self,
        values: Tensor,
        *,
        per_unit_bound: float,
        noise_multiplier: float,
        name: str,
        round: int,
        units: str = ALL_UNITS,
    ) -> Tensor:
        """``gaussian_sum`` for B independent repetitions at once: values (B, ...) + N(0, (z·bound)² I).

        For Monte-Carlo simulation: row r is the same release computed on the r-th of B
        independent data sets, and gets its own independent noise (one draw of shape (B, ...)).
        One :class:`Release` is recorded per call, describing what each repetition's units are
        touched by (the data sets are disjoint, so the ledger is the guarantee of every row).
        With B = 1 the noise equals ``gaussian_sum``'s for the same generator state.
        """
        if values.dim() < 1 or values.shape[0] < 1:
            raise ValueError(
                f"release {name!r}: expected a leading repetition dimension, got shape {tuple(values.shape)}"
            )
        self._check(values, per_unit_bound, noise_multiplier, name)
        release = self._record(round, name, "gaussian", per_unit_bound, noise_multiplier, units)
        return self._perturb(release, values, lambda: self._normal(tuple(values.shape), values))

    def symmetric_gaussian_sum(
        self,
        value: Tensor,
        *,
        per_unit_bound: float,
        noise_multiplier: float,
        name: str,
        round: int,
        units: str = ALL_UNITS,
        psd_units: bool = False,
        params: dict[str, Any] | None = None,
        sampling_probability: float = 1.0,
    ) -> Tensor:
        """Symmetric matrix sum + N_sym: upper triangle (with diagonal) i.i.d. N(0, σ²), mirrored.

        The upper triangle of a symmetric difference D has norm ≤ ||D||_F, so the Frobenius
        sensitivity bounds the Gaussian mechanism on the triangle. In general
        ||A_j − A'_j||_F ≤ 2B for per-unit contributions of Frobenius norm ≤ B.

        ``psd_units``: every unit's contribution is positive semi-definite. Then
        ||A_j − A'_j||_F² = ||A_j||² + ||A'_j||² − 2 tr(A_j A'_j) ≤ 2B², because the trace of a
        product of two PSD matrices is ≥ 0 (tr(A A') = ||A^{1/2} A'^{1/2}||_F²). So Δ = √2·B,
        reached by A_j = B·e₁e₁ᵀ, A'_j = B·e₂e₂ᵀ (then the triangle's norm is √2·B too).

        Poisson sampling (``sampling_probability`` q < 1): the tightening is NOT applied (Δ = 2B,
        σ = z·B). Why: the accountant's sampled replace-one event ``PoissonSampled(q, Gaussian(z))``
        (dp-accounting's REPLACE adjacency) is the pair (1−q)N(0, z²) + qN(∓1, z²): it models each
        unit as at most Δ/2 = σ/z from the sum without it — the unit is absent from the sample
        with probability 1 − q, so its distance *from absent* matters, not only ||A_j − A'_j||.
        A PSD unit is ||A_j|| = B from absent, not Δ/2 = B/√2: with the tightened σ = z·B/√2 the
        reachable pair A_j ⟂ A'_j at full norm puts each unit √2·σ/z from absent and the true
        ε exceeds the accounted one (1.7× for the A release at z = 2, q = 0.1;
        ``tests/test_psd_sampled.py`` computes it directly). Untightened, σ = z·B puts every unit
        within B = σ/z of absent, which is exactly what the event assumes (its antipodal pair is the
        worst pair in that ball), so the event is sound for every pair of PSD — or any — units.

        ``psd_units`` is refused when the summed value is not PSD (λ_min below −√eps·tr, far below
        any rounding of a sum of PSD matrices): a statistic that is not a sum of PSD
        contributions must not get the √2 bound. The check is made before anything is recorded.

        Add-remove neighbours: Δ = B for any units, PSD or not (the tightening compares two units;
        adding or removing one moves the sum by its own norm, up to B).

        Only the upper triangle of ``value`` is released (mirrored): were the lower one used,
        any asymmetry of the sum (rounding included) would come out exactly, noise-free.
        """
        if value.dim() != 2 or value.shape[0] != value.shape[1]:
            raise ValueError(f"release {name!r}: expected a square matrix, got shape {tuple(value.shape)}")
        self._check(value, per_unit_bound, noise_multiplier, name)
        if not 0.0 < sampling_probability <= 1.0:
            raise ValueError(f"release {name!r}: sampling_probability must be in (0, 1], got {sampling_probability}")
        if psd_units:
            check_psd_sum(value, name)
        add_remove = self.neighbours is Neighbours.ADD_REMOVE
        tighten = psd_units and sampling_probability >= 1.0 and not add_remove
        sensitivity = (
            psd_sensitivity(per_unit_bound, sampling_probability, self.neighbours)
            if psd_units
            else self.neighbours.sensitivity_factor * float(per_unit_bound)
        )
        if psd_units and not tighten:
            params = {
                **(params or {}),
                "psd_tightening": "not applicable: add-remove, a unit's distance from absent is its bound (Δ = bound)"
                if add_remove
                else "not applied: Poisson-sampled, a unit is a full bound from absent (Δ = 2·bound)",
            }
        release = self._record(
            round,
            name,
            "symmetric_gaussian",
            per_unit_bound,
            noise_multiplier,
            units,
            sensitivity,
            params,
            sampling_probability,
        )
        value = torch.triu(value) + torch.triu(value, diagonal=1).transpose(0, 1)

        def noise() -> Tensor:
            z = torch.triu(self._normal(tuple(value.shape), value))
            return z + torch.triu(z, diagonal=1).transpose(0, 1)

        return self._perturb(release, value, noise)

    def exponential(
        self,
        scores: Tensor,
        *,
        sensitivity: float,
        epsilon: float,
        name: str,
        round: int,
        units: str = ALL_UNITS,
        params: dict[str, Any] | None = None,
    ) -> int:
        """Index drawn with P(i) ∝ exp(−ε·score_i/(2Δ)) (low score is good), by Gumbel-max.

        ``sensitivity`` Δ is the change of any score between neighbours under the Privatizer's relation
        (the caller's: a score whose per-unit terms lie in [0, B] has Δ = B under either). ε = ∞ returns
        the argmin.
        """
        if scores.dim() != 1 or scores.numel() == 0:
            raise ValueError(f"release {name!r}: scores must be a non-empty vector, got shape {tuple(scores.shape)}")
        if not torch.isfinite(scores).all():
            raise ValueError(f"release {name!r}: scores have non-finite values")
        if not epsilon > 0:
            raise ValueError(f"release {name!r}: epsilon must be > 0, got {epsilon}")
        if not (sensitivity > 0 and math.isfinite(sensitivity)):
            raise ValueError(f"release {name!r}: sensitivity must be finite and > 0, got {sensitivity}")
        release = Release(
            round,
            name,
            "exponential",
            sensitivity / self.neighbours.sensitivity_factor,
            sensitivity,
            0.0,
            units,
            PureDpEvent(float(epsilon)),
            dict(params or {}),
            self.neighbours.value,
        )
        self.ledger.append(release)

        def sample() -> int:
            if math.isinf(epsilon):
                return int(torch.argmin(scores))
            if self.secure:
                return secure_module.noisy_argmin(scores, 2 * sensitivity / epsilon)
            logits = -epsilon * scores.double().cpu() / (2 * sensitivity)
            u = torch.rand(scores.shape, generator=self.generator, dtype=torch.float64).clamp_min(1e-300)
            return int(torch.argmax(logits - torch.log(-torch.log(u))))

        return self._select(release, scores, sample)

    def _select(self, release: Release, scores: Tensor, sample: Callable[[], int]) -> int:
        """The one place the exponential mechanism's scores meet its randomness."""
        return sample()

    def dp_covariance(
        self, A: Tensor, *, params: DpCovarianceParams, name: str, round: int, units: str = ALL_UNITS
    ) -> CovarianceRelease:
        """DPCovariance(A, k): B = (1/k) Σ_{i≤k} g_i g_iᵀ with g_i ~ N(0, A) i.i.d.

        The draw IS the noise, so it lives here. It is made, and recorded as an (ε, δ) event, only
        when every precondition of Theorem 3.1 holds: one the public parameters decide is refused
        (ValueError; the config refuses it before any work), one decided on the data (XXᵀ ⪰ ηI,
        max|A_ij| ≤ r) fails the run (:class:`~fedpers.config.PreconditionFailed`) with nothing drawn
        or recorded. Which of the two promises failed is then known to whoever sees the failure: the
        theorem's guarantee covers only data that keep its promises.

        Sampling: with A = SSᵀ (S from the eigendecomposition, so a singular A works),
        Σ g gᵀ = S W Sᵀ with W ~ Wishart(k, I_n). For k ≥ n, W is drawn exactly by the
        Bartlett decomposition in O(n²) instead of O(k n²); for k < n the k vectors are drawn.
        """
        if self.neighbours is not Neighbours.REPLACE_ONE:
            raise ValueError(
                f"release {name!r}: neighbours {self.neighbours.value}: DPCovariance's (ε, δ) is stated for the "
                "paper's relation (one column moved by at most β), not for adding or removing a column"
            )
        n = params.rows
        if A.dim() != 2 or tuple(A.shape) != (n, n):
            raise ValueError(f"release {name!r}: expected an ({n}, {n}) matrix, got shape {tuple(A.shape)}")
        if not torch.isfinite(A).all():
            raise ValueError(f"release {name!r}: the summed statistic has non-finite values")
        if not params.k >= 1:
            raise ValueError(f"release {name!r}: k must be >= 1, got {params.k}")
        asym = float((A - A.transpose(0, 1)).abs().max())
        if asym > 100 * torch.finfo(A.dtype).eps * max(float(A.abs().max()), 1e-300):
            raise ValueError(f"release {name!r}: A must be symmetric (max asymmetry {asym:.3g})")
        for field_name in ("epsilon", "delta", "alpha", "beta", "eta", "r", "gamma"):
            v = getattr(params, field_name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"release {name!r}: {field_name} must be finite and > 0, got {v}")
        if not params.gamma < 1:
            raise ValueError(f"release {name!r}: gamma must be < 1, got {params.gamma}")
        conditions = dp_covariance_conditions(params, A)
        public = {c.name for c in public_conditions(params)}
        declared = [c for c in conditions if not c.holds and c.name in public]
        if declared:  # a protocol built around its config (the config refuses these values)
            raise ValueError(f"release {name!r}: Theorem 3.1 needs " + "; ".join(c.text for c in declared))
        failed = [c for c in conditions if not c.holds]
        if failed:  # decided on the data: nothing is drawn or recorded, and the run fails
            raise PreconditionFailed(
                f"release {name!r}: the data break a promise of Theorem 3.1 ({'; '.join(c.text for c in failed)}), "
                "so its (ε, δ) would not hold and nothing was released; declare promises the data keep "
                "(--eta, --r, --alpha)"
            )
        event = EpsilonDeltaDpEvent(float(params.epsilon), float(params.delta))
        release = Release(
            round,
            name,
            "dp_covariance",
            float(params.alpha**2),
            float(params.sensitivity),
            0.0,
            units,
            event,
            {
                "alpha": params.alpha,
                "beta": params.beta,
                "eta": params.eta,
                "rows": params.rows,
                "k": params.k,
                "sensitivity_formula": "2αβ√n/η",
            },
            self.neighbours.value,
        )
        self.ledger.append(release)
        B = self._sample_covariance(release, A, lambda: self._wishart_draw(A, params))
        return CovarianceRelease(B.to(device=A.device, dtype=A.dtype), conditions)

    def _sample_covariance(self, release: Release, A: Tensor, draw: Callable[[], Tensor]) -> Tensor:
        """The one place DPCovariance's input meets its randomness."""
        return draw()

    def _wishart_draw(self, A: Tensor, params: DpCovarianceParams) -> Tensor:
        n = params.rows
        vals, vecs = torch.linalg.eigh(A.double().cpu())
        S = vecs * vals.clamp_min(0).sqrt()
        k = int(params.k)
        if k >= n:
            seed = (
                secure_module.os_seed() if self.secure else int(torch.randint(0, 2**62, (1,), generator=self.generator))
            )
            rng = np.random.Generator(np.random.PCG64(seed))
            bartlett = np.tril(rng.standard_normal((n, n)), -1)  # Bartlett's factor: W = LLᵀ ~ Wishart(I, k)
            bartlett[np.diag_indices(n)] = np.sqrt(rng.chisquare(k - np.arange(n)))
            L = torch.from_numpy(bartlett)
            W = L @ L.transpose(0, 1)
        else:
            Z = torch.randn((n, k), generator=self.generator, dtype=torch.float64)
            W = Z @ Z.transpose(0, 1)
        return linalg.sym(S @ (W / k) @ S.transpose(0, 1))
