"""Non-private reference recommender of a rating run: biased ALS tuned on a validation split.

r̂_ui = μ + b_u + c_i + p_iᵀ v_u, fitted by alternating ridge solves (users: [v_u, b_u] against
[p_i, 1]; items: [p_i, c_i] against [v_u, 1]), with λ chosen on a per-user validation split of
the training ratings and the model refitted on all of them. It sees every rating unclipped and
unnoised: the bar a private run is measured against, not a release.

Units are the padded form of :mod:`fedpers.data.ratings`: ``items`` (n, m), ``ratings`` (n, m),
``mask`` (training ratings), ``test`` (held-out ratings).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from fedpers import linalg
from fedpers.protocols.dpals import spd_solve

Tensor = torch.Tensor
RIDGES = (1.0, 3.0, 10.0, 30.0)
"""λ tried on the validation split (the same λ for factors and biases)."""


class _Pairs:
    """The rated (row, column) pairs as a CSR matrix (rows × columns) whose entries are the pairs
    in a fixed order (each row's pairs in the order of ``order``), for sums over a row's pairs of
    a per-column vector: ``ones @ F`` is Σ F[column] and :meth:`weighted` ``(w) @ F`` is Σ w F[column]."""

    def __init__(self, row: Tensor, column: Tensor, rows: int, columns: int) -> None:
        self.order = torch.sort(row, stable=True).indices  # each row's pairs in their given order
        self.crow = torch.zeros(rows + 1, dtype=torch.int64)
        self.crow[1:] = torch.cumsum(torch.bincount(row, minlength=rows), 0)
        self.col = column[self.order]
        self.shape = (rows, columns)
        self.ones = self.weighted(torch.ones(row.shape[0], dtype=torch.float64))

    def weighted(self, w: Tensor) -> Tensor:
        """The CSR matrix with entry w[p] at pair p (w in the pairs' given order)."""
        with warnings.catch_warnings():  # "sparse CSR support is in beta": the product used here is stable
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(self.crow, self.col, w[self.order], self.shape, check_invariants=False)


def _solve_pairs(pairs: _Pairs, X: Tensor, y: Tensor, ridge: float) -> Tensor:
    """Per row g of ``pairs``: (Σ x xᵀ + λI)⁻¹ Σ y x over its pairs, x = X[column] (X (columns, d),
    y per pair). The outer products x xᵀ are formed once per column, not once per pair: the same
    products summed in the same order as over per-pair copies, at a fraction of the memory traffic.
    λ > 0 makes every system positive definite."""
    d = X.shape[1]
    outer = (X.unsqueeze(-1) * X.unsqueeze(-2)).reshape(-1, d * d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        A = (pairs.ones @ outer).reshape(-1, d, d)
        rhs = pairs.weighted(y) @ X
    A.diagonal(dim1=-2, dim2=-1).add_(ridge)
    return linalg.small_batched(spd_solve, A, rhs, min_share=1024)


def fit(
    items: Tensor, ratings: Tensor, mask: Tensor, n_items: int, rank: int, ridge: float, steps: int, seed: int
) -> tuple[float, Tensor, Tensor, Tensor, Tensor]:
    """(μ, P (items, k), c (items,), V (users, k), b (users,)) of biased ALS on the masked ratings
    (many small ops: on this thread alone, the users' k×k solves in single-threaded shares)."""
    with linalg.serial_small_ops(items.device):
        return _fit(items, ratings, mask, n_items, rank, ridge, steps, seed)


def _fit(
    items: Tensor, ratings: Tensor, mask: Tensor, n_items: int, rank: int, ridge: float, steps: int, seed: int
) -> tuple[float, Tensor, Tensor, Tensor, Tensor]:
    user, slot = mask.nonzero(as_tuple=True)
    item, r = items[user, slot], ratings.double()[user, slot]
    n = items.shape[0]
    by_user, by_item = _Pairs(user, item, n, n_items), _Pairs(item, user, n_items, n)
    mu = float(r.mean()) if r.numel() else 0.0
    g = torch.Generator().manual_seed(seed)
    P = 0.1 * torch.randn(n_items, rank, generator=g, dtype=torch.float64)
    c = torch.zeros(n_items, dtype=torch.float64)
    V = torch.zeros(n, rank, dtype=torch.float64)
    b = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        sol = _solve_pairs(
            by_user, torch.cat([P, torch.ones(n_items, 1, dtype=torch.float64)], 1), r - mu - c[item], ridge
        )
        V, b = sol[:, :rank], sol[:, rank]
        sol = _solve_pairs(by_item, torch.cat([V, torch.ones(n, 1, dtype=torch.float64)], 1), r - mu - b[user], ridge)
        P, c = sol[:, :rank], sol[:, rank]
    return mu, P, c, V, b


def rmse(fitted: tuple[float, Tensor, Tensor, Tensor, Tensor], items: Tensor, ratings: Tensor, where: Tensor) -> float:
    """RMSE of the fitted model on the ratings selected by ``where`` (NaN if none); predicted at
    those ratings alone."""
    mu, P, c, V, b = fitted
    user, slot = where.nonzero(as_tuple=True)
    item = items[user, slot]
    pred = mu + b[user] + c[item] + (P[item] * V[user]).sum(-1)
    err = pred - ratings.double()[user, slot]
    return float(err.pow(2).mean().sqrt()) if err.numel() else math.nan


def validation_split(mask: Tensor, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """(fit, validation) masks: each training rating goes to validation with probability ``fraction``
    (seeded), keeping at least one fitting rating per user where the user has one."""
    g = torch.Generator().manual_seed(seed)
    held = (torch.rand(mask.shape, generator=g) < fraction) & mask
    first = torch.zeros_like(mask)
    has = mask.any(1)
    first[has, mask[has].int().argmax(1)] = True
    held &= ~first
    return mask & ~held, held


@dataclass(frozen=True)
class Tuned:
    """The tuned reference: its test RMSE, the λ the validation split chose, its item factors P."""

    test_rmse: float
    ridge: float
    P: Tensor


def tuned(units: dict[str, Tensor], n_items: int, rank: int, steps: int = 10, seed: int = 0) -> Tuned:
    """λ chosen from :data:`RIDGES` on a 10 % validation split of the training ratings (the test
    ratings are never looked at), then the model refitted on all training ratings (many small
    ops: on this thread alone, see :func:`fit`)."""
    with linalg.serial_small_ops(units["items"].device):
        return _tuned(units, n_items, rank, steps, seed)


def _tuned(units: dict[str, Tensor], n_items: int, rank: int, steps: int, seed: int) -> Tuned:
    items, ratings, mask, test = units["items"], units["ratings"], units["mask"], units["test"]
    fit_mask, val_mask = validation_split(mask, 0.1, seed)
    scores = {
        lam: rmse(fit(items, ratings, fit_mask, n_items, rank, lam, steps, seed), items, ratings, val_mask)
        for lam in RIDGES
    }
    lam = min(RIDGES, key=lambda x: math.inf if math.isnan(scores[x]) else scores[x])
    fitted = fit(items, ratings, mask, n_items, rank, lam, steps, seed)
    return Tuned(rmse(fitted, items, ratings, test), lam, fitted[1])
