"""Synthetic data for DP attention (docs/algorithms.md §4): the d columns of X ∈ R^{n×d}, generated per column id.

Each column is uniform on the sphere of radius ``norm`` in R^n, so E[XXᵀ] = (d·norm²/n) I:
with ``norm = sqrt(fill·r·n/d)`` the diagonal of A = XXᵀ is about fill·r (so ||A||_∞ ≤ r
for fill < 1 and large d) and λ_min(A) ≈ fill·r·(1 − sqrt(n/d))² (Marchenko–Pastur).
"""

from __future__ import annotations

import torch

from fedpers.data.synthetic import _generator

Tensor = torch.Tensor
BLOCK = 4096
_STREAM_COLUMNS = 21


def columns(seed: int, ids: Tensor, rows: int, norm: float, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """x (len(ids), n): the columns with these ids, each of norm ``norm``."""
    ids = ids.to("cpu", torch.int64)
    out = torch.empty(int(ids.shape[0]), rows, dtype=torch.float64)
    blocks = ids // BLOCK
    for blk in torch.unique(blocks).tolist():
        g = _generator(seed, _STREAM_COLUMNS, blk)
        z = torch.randn(BLOCK, rows, generator=g, dtype=torch.float64)
        z = z / torch.linalg.vector_norm(z, dim=-1, keepdim=True)
        rows_ = (blocks == blk).nonzero().squeeze(1)
        out[rows_] = norm * z[ids[rows_] - blk * BLOCK]
    return {"ids": ids, "x": out.to(dtype)}
