"""Population MSE: how well a released U serves a user it has not seen fit on.

Each user refits v_j by least squares on R fresh samples with the released U (locally, never
sent) and is tested on S more; the metric is the mean over users of the test MSE (Snedeker,
Zhou & Bassily 2025). Shared by ``run fedrep`` and ``run altmin`` so both report one number
on one problem.
"""

from __future__ import annotations

import torch

from fedpers import linalg
from fedpers.data import synthetic
from fedpers.data.units import UnitSource

Tensor = torch.Tensor
KEYS = ("x_refit", "y_refit", "x_test", "y_test")


def fresh_samples(
    seed: int, ids: Tensor, u_star: Tensor, v_star: Tensor, count: int, noise_std: float
) -> tuple[Tensor, Tensor]:
    """``count`` new samples per user from their own (U*, v*_j): x ~ N(0, I), y = ⟨U*ᵀx, v*_j⟩ + σ_F·z,
    x and z from (seed, user id) (a stream apart from the training data)."""
    noise = synthetic.altmin_users(seed, ids, torch.zeros_like(u_star, dtype=torch.float64), count, 1.0)
    x = noise["x"]
    y = ((x @ u_star.double()) @ v_star.double().unsqueeze(-1)).squeeze(-1) + noise_std * noise["y"]
    return x, y


def population_mse(
    source: UnitSource, Us: dict[str, Tensor], chunk_size: int, keys: tuple[str, str, str, str] = KEYS
) -> dict[str, float]:
    """name → mean over users of the test MSE after refitting v_j on the refit samples with that
    U (least squares), every U in one pass over the users."""
    totals, users = {name: 0.0 for name in Us}, 0
    for units in source.chunks(chunk_size):
        x, y, xt, yt = (units[k].double() for k in keys)
        for name, U in Us.items():
            Ud = U.double().to(x.device)
            v = linalg.lstsq(x @ Ud, y.unsqueeze(-1))
            pred = ((xt @ Ud) @ v).squeeze(-1)
            totals[name] += float(((pred - yt) ** 2).mean(-1).sum())
        users += int(units["ids"].shape[0])
    return {name: t / max(users, 1) for name, t in totals.items()}
