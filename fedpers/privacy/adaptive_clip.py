"""Accounted adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021; docs/algorithms.md §6).

A clip bound C_t moves each round toward the γ-quantile of what it clips: every unit of the
round sends b_j − 1/2 with b_j ∈ [0, 1] the part of it within C_t (an indicator, or the fraction
of a user's samples), the sum is released through the :class:`~fedpers.privacy.Privatizer` (per-unit
bound 1/2, Δ = 1) and recorded in the ledger like any other release, and
C_{t+1} = C_t·exp(−η_C(b̄ − γ)) with b̄ = (noisy sum + n_t/2)/n_t over the public cohort size n_t.
The next bound is made from public configuration and released counts only. Every protocol with
an adaptive bound (FedRep, NoisyGD, AltMin's η and ζ, NoisyHead's rounds) uses this one rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fedpers.privacy.ledger import ALL_UNITS
from fedpers.privacy.mechanisms import Privatizer

Tensor = torch.Tensor

COUNT_BOUND = 0.5
"""Per-unit bound of a count statistic b_j − 1/2 (b_j ∈ [0, 1]): replace-one Δ = 1."""


def share_multiplier(noise_multiplier: float, share: float) -> float:
    """Multiplier of a release that takes ``share`` of the μ² (1/z²) of a Gaussian with multiplier z:
    z/√share (inf for no share). Releases whose shares add up to 1 compose to exactly that Gaussian."""
    return noise_multiplier / math.sqrt(share) if share > 0 else math.inf


class SplitRoundBudget:
    """For a protocol whose round is one gradient release plus, under adaptive clipping, one count:
    the round's μ² (1/z²) splits 1 − f : f between them, so they compose to the fixed-clip round's z.
    A mixin for frozen dataclasses that hold ``noise_multiplier`` z, ``count_share`` f and
    ``clip_quantile`` γ (0: fixed clip)."""

    noise_multiplier: float
    count_share: float
    clip_quantile: float

    @property
    def adaptive(self) -> bool:
        return self.clip_quantile > 0

    @property
    def round_multiplier(self) -> float:
        """z/√(1 − f): the gradient release's multiplier (z itself without adaptive clipping)."""
        return share_multiplier(self.noise_multiplier, 1.0 - self.count_share)

    @property
    def count_multiplier(self) -> float:
        """z/√f: the count release's multiplier."""
        return share_multiplier(self.noise_multiplier, self.count_share)


def below_statistic(within: Tensor, dtype: torch.dtype) -> Tensor:
    """Σ_j (b_j − 1/2) of the units' b_j ∈ [0, 1] (a 0-dim tensor): each term is within :data:`COUNT_BOUND`."""
    return (within.to(dtype) - 0.5).sum()


@dataclass(frozen=True)
class AdaptiveClip:
    """The public rule of one adaptive bound: target quantile γ and geometric step η_C."""

    quantile: float
    lr: float

    def next_bound(self, bound: float, fraction: float) -> float:
        """C_{t+1} = C_t·exp(−η_C(b̄ − γ))."""
        return bound * math.exp(-self.lr * (fraction - self.quantile))

    def release(
        self,
        privatizer: Privatizer,
        below: Tensor,
        *,
        bound: float,
        size: float,
        noise_multiplier: float,
        name: str,
        round: int,
        statistic: str,
        units: str = ALL_UNITS,
        params: dict[str, Any] | None = None,
        sampling_probability: float = 1.0,
    ) -> tuple[float, float]:
        """Release the noisy Σ (b_j − 1/2) of a round whose bound was ``bound``; returns (b̄, the next
        bound), b̄ the noisy fraction of the public ``size`` (never of a realised count)."""
        noisy = privatizer.gaussian_sum(
            below,
            per_unit_bound=COUNT_BOUND,
            noise_multiplier=noise_multiplier,
            name=name,
            round=round,
            units=units,
            params={
                "statistic": statistic,
                "clip": bound,
                "target_quantile": self.quantile,
                "formula": "bound 1/2, Δ = 1 (one unit's b_j ∈ [0, 1])",
                **(params or {}),
            },
            sampling_probability=sampling_probability,
        )
        fraction = (float(noisy) + size / 2) / size
        return fraction, self.next_bound(bound, fraction)
