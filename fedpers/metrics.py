"""Metrics that are exact for Gaussian x (no test sampling): subspace errors and excess risk."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def subspace_error(U: Tensor, u_star: Tensor) -> float:
    """||(I − U*U*ᵀ)U||_F for orthonormal U, U*."""
    U, u_star = U.double(), u_star.double()
    return float(torch.linalg.matrix_norm(U - u_star @ (u_star.T @ U)))


def subspace_error_spectral(U: Tensor, u_star: Tensor) -> float:
    """||(I − U*U*ᵀ)U||_2: the sine of the largest principal angle."""
    U, u_star = U.double(), u_star.double()
    return float(torch.linalg.matrix_norm(U - u_star @ (u_star.T @ U), ord=2))


def excess_risk(theta: Tensor, theta_star: Tensor) -> float:
    """mean_j ||θ_j − θ*_j||²: for x ~ N(0, I) this is the exact excess population risk."""
    return float(((theta.double() - theta_star.double()) ** 2).sum(-1).mean())


def mse(theta: Tensor, x: Tensor, y: Tensor) -> float:
    """Mean squared error of per-user linear models θ_j on held-out (x, y)."""
    pred = (x.double() @ theta.double().unsqueeze(-1)).squeeze(-1)
    return float(((pred - y.double()) ** 2).mean())
