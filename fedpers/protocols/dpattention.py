"""DP attention computation by DPCovariance (docs/algorithms.md §4, dp-attention-computation).

X ∈ R^{n×d}, d ≫ n; the privacy units are the d columns (neighbours: one column moves by
≤ β). One round: each client clips every column it holds to norm α (so "column norms ≤ α"
holds by construction) and sends its partial ``Σ x xᵀ``; the server sums to A = XXᵀ,
releases B = DPCovariance(A, k) through the Privatizer (which checks every precondition of
Theorem 3.1 and releases nothing unless all hold) and publishes the attention matrix
D(B)⁻¹f(B), f ∈ {exp, cosh} entrywise, D(B) = diag(f(B)1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedpers import linalg
from fedpers.configs.dpattention import AttentionFn
from fedpers.privacy import DpCovarianceParams, Privatizer
from fedpers.protocols.base import Message, Protocol, StatSpec, Units

Tensor = torch.Tensor


def attention_matrix(A: Tensor, f: AttentionFn) -> Tensor:
    """D(A)⁻¹ f(A): f entrywise, rows normalised by D(A) = diag(f(A) 1)."""
    fa = torch.exp(A) if f is AttentionFn.EXP else torch.cosh(A)
    return fa / fa.sum(-1, keepdim=True)


def entrywise_max_norm(M: Tensor) -> float:
    """||M||_∞ as the paper uses it for matrices: max_ij |M_ij|."""
    return float(M.abs().max())


@dataclass(frozen=True)
class DpAttentionProtocol(Protocol):
    """Public parameters: the DPCovariance parameters and f."""

    params: DpCovarianceParams
    f: AttentionFn = AttentionFn.EXP
    dtype_name: str = "float64"

    name = "dpattention"

    @property
    def num_rounds(self) -> int:
        return 1

    def unit_keys(self) -> tuple[str, ...]:
        return ("x",)

    def initial_state(self) -> dict[str, Tensor]:
        return {}

    def broadcast(self, state: Mapping[str, Any], round: int) -> dict[str, Tensor]:
        return {}

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        n = self.params.rows
        return (StatSpec("A", (n, n), self.params.alpha**2, symmetric=True),)  # ||x xᵀ||_F = ||x||² ≤ α²

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        x = linalg.clip_vectors(units["x"].to(self.dtype), self.params.alpha)  # (columns, n)
        return Message({"A": linalg.sym(x.transpose(0, 1) @ x)}, int(x.shape[0]))

    def server_update(
        self, round: int, state: Mapping[str, Any], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Any], dict[str, float]]:
        release = privatizer.dp_covariance(summed.stats["A"], params=self.params, name="dp_covariance.B", round=round)
        new = {
            "B": release.B,
            "attention": attention_matrix(release.B, self.f),
            # only booleans and the conditions' public wording: the values they were decided on
            # (λ_min(XXᵀ), max|A_ij|) are exact statistics of the data and never leave the server
            "conditions": {c.name: {"holds": c.holds, "text": c.text} for c in release.conditions},
        }
        # Condition outcomes are decided on the exact A (that is what the theorem requires) but
        # only as booleans; the values are not kept in the state or the result.
        return new, {}
