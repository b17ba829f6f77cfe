"""Noise mechanisms. The only place in fedpers that adds noise.

A :class:`Privatizer` lives on the server: it owns the DP-noise generator (clients never
see its seed) and the ledger. Every method validates its arguments, draws the noise,
and appends one :class:`~fedpers.privacy.ledger.Release` before returning the release.

Conventions: ``per_unit_bound`` is the norm bound (L2, Frobenius for matrices) of one
unit's contribution to the sum; neighbours are replace-one, so the L2 sensitivity is
``2 * per_unit_bound``; ``noise_multiplier`` is ``noise_std / per_unit_bound``
(dp-accounting's convention) and ``noise_std`` is σ itself.

The generators are torch's (not cryptographic): fine for simulation, not for deployment
against a real adversary.
"""
from __future__ import annotations

import math

import dp_accounting
import torch

from fedpers.privacy.ledger import ALL_UNITS, Ledger, PureDpEvent, Release

Tensor = torch.Tensor


class Privatizer:
    """Server-side mechanisms with a private generator and the ledger they append to."""

    def __init__(self, seed: int, ledger: Ledger | None = None) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(int(seed))
        self.ledger = ledger if ledger is not None else Ledger()

    def _normal(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        # Drawn on the CPU in float64 so a run reproduces across devices and dtypes.
        z = torch.randn(shape, generator=self.generator, dtype=torch.float64)
        return z.to(device=like.device, dtype=like.dtype)

    @staticmethod
    def _check(value: Tensor, per_unit_bound: float, noise_multiplier: float, name: str) -> None:
        if not torch.isfinite(value).all():
            raise ValueError(f"release {name!r}: the summed statistic has non-finite values")
        if not (per_unit_bound > 0 and math.isfinite(per_unit_bound)) and noise_multiplier > 0:
            raise ValueError(f"release {name!r}: per_unit_bound must be finite and > 0 to add calibrated noise, got {per_unit_bound}")
        if not noise_multiplier >= 0 or math.isinf(noise_multiplier):
            raise ValueError(f"release {name!r}: noise_multiplier must be in [0, inf), got {noise_multiplier}")

    def _record(self, round: int, name: str, mechanism: str, bound: float, z: float, units: str) -> float:
        noise_std = z * bound if z > 0 else 0.0
        event = dp_accounting.GaussianDpEvent(z) if z > 0 else dp_accounting.NonPrivateDpEvent()
        self.ledger.append(Release(round, name, mechanism, float(bound), 2.0 * float(bound), float(noise_std), units, event))
        return noise_std

    def gaussian_sum(
        self, value: Tensor, *, per_unit_bound: float, noise_multiplier: float, name: str, round: int, units: str = ALL_UNITS
    ) -> Tensor:
        """Sum of clipped unit contributions + N(0, (z·bound)² I)."""
        self._check(value, per_unit_bound, noise_multiplier, name)
        std = self._record(round, name, "gaussian", per_unit_bound, noise_multiplier, units)
        if std == 0:
            return value.clone()
        return value + std * self._normal(tuple(value.shape), value)

    def gaussian_sum_batched(
        self, values: Tensor, *, per_unit_bound: float, noise_multiplier: float, name: str, round: int, units: str = ALL_UNITS
    ) -> Tensor:
        """``gaussian_sum`` for B independent repetitions at once: values (B, ...) + N(0, (z·bound)² I).

        For Monte-Carlo simulation: row r is the same release computed on the r-th of B
        independent data sets, and gets its own independent noise (one draw of shape (B, ...)).
        One :class:`Release` is recorded per call, describing what each repetition's units are
        touched by (the data sets are disjoint, so the ledger is the guarantee of every row).
        With B = 1 the noise equals ``gaussian_sum``'s for the same generator state.
        """
        if values.dim() < 1 or values.shape[0] < 1:
            raise ValueError(f"release {name!r}: expected a leading repetition dimension, got shape {tuple(values.shape)}")
        self._check(values, per_unit_bound, noise_multiplier, name)
        std = self._record(round, name, "gaussian", per_unit_bound, noise_multiplier, units)
        if std == 0:
            return values.clone()
        return values + std * self._normal(tuple(values.shape), values)

    def symmetric_gaussian_sum(
        self, value: Tensor, *, per_unit_bound: float, noise_multiplier: float, name: str, round: int, units: str = ALL_UNITS
    ) -> Tensor:
        """Symmetric matrix sum + N_sym: upper triangle (with diagonal) i.i.d. N(0, σ²), mirrored.

        The upper triangle of a symmetric difference has norm ≤ its Frobenius norm, so the
        Frobenius sensitivity bounds the Gaussian mechanism on the triangle.
        """
        if value.dim() != 2 or value.shape[0] != value.shape[1]:
            raise ValueError(f"release {name!r}: expected a square matrix, got shape {tuple(value.shape)}")
        self._check(value, per_unit_bound, noise_multiplier, name)
        std = self._record(round, name, "symmetric_gaussian", per_unit_bound, noise_multiplier, units)
        if std == 0:
            return value.clone()
        z = torch.triu(self._normal(tuple(value.shape), value))
        return value + std * (z + torch.triu(z, diagonal=1).transpose(0, 1))

    def exponential(
        self, scores: Tensor, *, sensitivity: float, epsilon: float, name: str, round: int, units: str = ALL_UNITS
    ) -> int:
        """Index drawn with P(i) ∝ exp(−ε·score_i/(2Δ)) (low score is good), by Gumbel-max.

        ``sensitivity`` Δ is the replace-one change of any score. ε = ∞ returns the argmin.
        """
        if scores.dim() != 1 or scores.numel() == 0:
            raise ValueError(f"release {name!r}: scores must be a non-empty vector, got shape {tuple(scores.shape)}")
        if not torch.isfinite(scores).all():
            raise ValueError(f"release {name!r}: scores have non-finite values")
        if not epsilon > 0:
            raise ValueError(f"release {name!r}: epsilon must be > 0, got {epsilon}")
        if not (sensitivity > 0 and math.isfinite(sensitivity)):
            raise ValueError(f"release {name!r}: sensitivity must be finite and > 0, got {sensitivity}")
        self.ledger.append(
            Release(round, name, "exponential", sensitivity / 2, sensitivity, 0.0, units, PureDpEvent(float(epsilon)))
        )
        if math.isinf(epsilon):
            return int(torch.argmin(scores))
        logits = -epsilon * scores.double().cpu() / (2 * sensitivity)
        u = torch.rand(scores.shape, generator=self.generator, dtype=torch.float64).clamp_min(1e-300)
        gumbel = -torch.log(-torch.log(u))
        return int(torch.argmax(logits + gumbel))
