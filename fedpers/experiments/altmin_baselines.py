"""A competent non-private AltMin (FedRep's linear case), the reference a private run is read against.

Unlike the private protocol it has no privacy constraint to respect, so it does what a
non-private method would: every user's samples are used for both steps (no sample
splitting), local solves are ridge-regularised (a user with 3 samples in k dimensions has a
near-singular least squares, and a few such users dominated the old baseline's sums), it is
initialised by the same spectral statistic without clipping or noise, and it alternates
until U stops moving. It streams users chunk by chunk like the private run.
"""

from __future__ import annotations

import torch

from fedpers import linalg
from fedpers.data.units import UnitSource

Tensor = torch.Tensor
RIDGE = 1e-3
"""Ridge of the local solves, relative to the mean diagonal of each user's Gram matrix."""
MAX_ROUNDS = 30
TOLERANCE = 1e-6


def spectral_init(source: UnitSource, rank: int, chunk_size: int) -> Tensor:
    """Top-k eigenvectors of Σ_j Σ_pairs sym(x̂_a x̂_bᵀ) y_a y_b over all of a user's sample pairs."""
    total = None
    for units in source.chunks(chunk_size):
        x, y = units["x"].double(), units["y"].double()
        pairs = x.shape[1] // 2
        w = linalg.pair_statistic(x[:, : 2 * pairs], y[:, : 2 * pairs])
        total = w if total is None else total + w
    return linalg.top_eigenvectors(total, rank)


def local_solve(U: Tensor, x: Tensor, y: Tensor) -> Tensor:
    return linalg.batched_ridge_solve(x @ U, y, RIDGE)


def nonprivate_altmin(source: UnitSource, rank: int, chunk_size: int) -> tuple[Tensor, int]:
    """(U, rounds run): alternate v_j = ridge LS on all samples and the exact U step until convergence."""
    U = spectral_init(source, rank, chunk_size)
    d = U.shape[0]
    for rounds in range(1, MAX_ROUNDS + 1):  # noqa: B007  (returned: the rounds run)
        A = torch.zeros(d * rank, d * rank, dtype=torch.float64)
        b = torch.zeros(d * rank, dtype=torch.float64)
        for units in source.chunks(chunk_size):
            x, y = units["x"].double(), units["y"].double()
            v = local_solve(U, x, y)
            A += linalg.kron_gram_sum(v, x)
            b += (v.T @ (x * y.unsqueeze(-1)).sum(1)).reshape(-1)
        ridge = 1e-12 * float(A.diagonal().mean().clamp_min(1e-300))
        u = torch.linalg.solve(A + ridge * torch.eye(d * rank, dtype=A.dtype), b)
        new = linalg.orthonormal_basis(linalg.vec_to_matrix(u, d, rank))
        moved = float(torch.linalg.matrix_norm(new @ new.T - U @ U.T))
        U = new
        if moved < TOLERANCE:
            break
    return U, rounds
