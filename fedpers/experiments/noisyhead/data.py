"""NoisyHead's prompts: drawn from (seed, prompt id) or read from newsgroups, grouped per user, and the
robustness attack's perturbed prompt."""

from __future__ import annotations

import math

import torch

from fedpers.config import (
    device_path,
)
from fedpers.configs.noisyhead import (
    DEMO,
    DataSource,
    NoisyHeadConfig,
    Regime,
    Unit,
)
from fedpers.data import prompts as prompt_data

Tensor = torch.Tensor
STREAM_TRAIN, STREAM_TEST = 1, 2


def prompts(cfg: NoisyHeadConfig, ids: Tensor, test: bool = False) -> tuple[Tensor, Tensor]:
    """Prompts (x (n, L+1, D), y (n, L+1)) with these ids on ``cfg.device``; prompt k depends only on (seed, k).

    Host path: drawn on the CPU and copied. Device path (``kernels``): synthetic prompts drawn on
    the device from the same keys (on the CPU the very same prompts; on a GPU other ones from the
    same distribution); real text is read on the host and copied.
    """
    r = resolve_shape(cfg)
    stream = STREAM_TEST if test else STREAM_TRAIN
    if cfg.data is DataSource.NEWSGROUPS:
        from fedpers.data import newsgroups

        x, y = newsgroups.text_prompts_by_id(cfg.seed, stream, ids, r[1], r[2], test=test)
    elif device_path(cfg.device, cfg.kernels):
        return prompt_data.prompts_by_id(cfg.seed, stream, ids, r[1], r[2], cfg.label_noise, device=cfg.device)
    else:
        x, y = prompt_data.prompts_by_id(cfg.seed, stream, ids, r[1], r[2], cfg.label_noise)
    return x.to(cfg.device), y.to(cfg.device)


def resolve_shape(cfg: NoisyHeadConfig) -> tuple[int, int, int]:
    """N, L, D: a 0 context is ⌊√N⌋ (the demo regime's own L in the demo regime), a 0 dim ⌊√N⌋."""
    root = math.isqrt(cfg.prompts)
    context = DEMO.context if cfg.regime is Regime.DEMO else root
    return cfg.prompts, cfg.context or context, cfg.dim or root


def load_units(cfg: NoisyHeadConfig, ids: Tensor) -> dict[str, Tensor]:
    """Units with these ids: unit u holds prompts uP..uP+P−1 (P = 1 at the prompt level)."""
    P = cfg.prompts_per_user if cfg.unit is Unit.USER else 1
    ids = ids.to(cfg.device, torch.int64)
    prompt_ids = (ids.unsqueeze(-1) * P + torch.arange(P, device=ids.device)).reshape(-1)
    x, y = prompts(cfg, prompt_ids)
    return group_units(x, y, P, ids)


def group_units(x: Tensor, y: Tensor, P: int, ids: Tensor | None = None) -> dict[str, Tensor]:
    """Prompts (n·P, L+1, D) -> units (n, P, L+1, D) with their ids (default 0..n−1)."""
    n = x.shape[0] // P
    ids = torch.arange(n, device=x.device) if ids is None else ids
    return {"ids": ids, "x": x.reshape(n, P, *x.shape[1:]), "y": y.reshape(n, P, y.shape[-1])}


def sherman_morrison_replace(M_i: Tensor, rhs_i: Tensor, z_new: Tensor, y_new: Tensor) -> Tensor:
    """(M_i + z zᵀ)⁻¹(rhs_i + y z), stably, from the well-conditioned M_i; batched.

    Needed for the robustness attack: ||z'||² reaches 1e18 while M_i's eigenvalues are O(N), so a
    direct solve of the perturbed system is at the edge of float64 (condition number ~1e16).
    """
    chol = torch.linalg.cholesky(M_i)
    g0 = torch.cholesky_solve(rhs_i.unsqueeze(-1), chol).squeeze(-1)
    u = torch.cholesky_solve(z_new.unsqueeze(-1), chol).squeeze(-1)
    s = (z_new * u).sum(-1)
    return g0 + u * ((y_new - (z_new * g0).sum(-1)) / (1 + s)).unsqueeze(-1)


def attack_prompt(x: Tensor, y: Tensor, mu: float, alpha: float) -> tuple[Tensor, Tensor]:
    """(5.1): x' = x + μ·1 on all L+1 tokens, y' = y + α on the L context labels (the query label is kept)."""
    y2 = y.clone()
    y2[..., :-1] = y2[..., :-1] + alpha
    return x + mu, y2
