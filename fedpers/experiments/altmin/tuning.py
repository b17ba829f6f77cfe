"""AltMin's private scores (``fedpers sweep --select METRIC --private``): held-out users' validation error."""

from __future__ import annotations

from typing import Any

import torch

from fedpers.configs.altmin import AltMinConfig
from fedpers.experiments.altmin.plan import load_units
from fedpers.experiments.hooks import PrivateScore
from fedpers.protocols.altmin import AltMinProtocol

Tensor = torch.Tensor


VALIDATION_CLIP = 4.0
"""A held-out user's validation MSE is clipped to [0, 4·(k + σ_F²)] (k + σ_F² is the label variance
of the synthetic model, public): the per-user bound of the score release."""


def validation_mse(cfg: AltMinConfig, protocol: AltMinProtocol, state: Any, units: dict[str, Tensor]) -> Tensor:
    """Each held-out user fits v_j on its first half with the released U, and its MSE on the second."""
    U = state["U"].double()
    x, y = units["x"].double(), units["y"].double()
    h = x.shape[1] // 2
    v = protocol.local_solve(U, x[:, :h], y[:, :h])
    pred = ((x[:, h:] @ U) @ v.unsqueeze(-1)).squeeze(-1)
    return ((pred - y[:, h:]) ** 2).mean(1)


def heldout_units(cfg: AltMinConfig, ids: Tensor) -> dict[str, Tensor]:
    """Held-out users of the synthetic model (ids past the training population)."""
    if cfg.data is not None:
        raise ValueError("select --private: held-out users are drawn from the synthetic model; drop --data")
    return load_units(cfg, ids)


PRIVATE_SCORES = {
    "validation_mse": PrivateScore(
        "validation_mse",
        lambda cfg: VALIDATION_CLIP * (cfg.rank + cfg.noise_std**2),
        validation_mse,
        heldout_units,
    )
}
