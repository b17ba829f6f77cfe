"""Synthetic in-context regression prompts of docs/algorithms.md §2.

Prompt k: tokens ``x_{k,i} ~ Uniform(S^{D−1})``, ``w_k ~ N(0, I_D)``, ``y_{k,i} = w_kᵀx_{k,i} + τ ε_{k,i}``,
i = 1..L+1 (the last token is the query). Tensors: x (n, L+1, D), y (n, L+1).

Two generators:

- :func:`prompts_by_id`: prompt k depends only on (seed, stream, k), generated in fixed blocks,
  so any node can make exactly its own slice (runs, Flower nodes).
- :func:`prompt_batch`: B × n prompts from one generator in one call, for Monte-Carlo sweeps
  (drawn in float32, returned in float64: the draws' precision is statistically irrelevant
  and float32 normals are ~3× faster on a CPU).
"""

from __future__ import annotations

import numpy as np
import torch

Tensor = torch.Tensor
BLOCK = 256


def _seed(seed: int, *key: int) -> int:
    state = np.random.SeedSequence([int(seed), *map(int, key)]).generate_state(2, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def generator(seed: int, *key: int) -> torch.Generator:
    """The host (CPU) generator of (seed, key)."""
    return torch.Generator().manual_seed(_seed(seed, *key))


def device_generator(seed: int, *key: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded from (seed, key): the device code path draws its data with it.

    On the CPU it is the same generator as :func:`generator`; on a GPU its stream differs (Philox).
    """
    return torch.Generator(device=device).manual_seed(_seed(seed, *key))


def _draw(
    g: torch.Generator, shape: tuple[int, ...], context: int, dim: int, tau: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    dev = g.device  # draws on the generator's device: no host data on the device path
    x = torch.randn(*shape, context + 1, dim, generator=g, dtype=dtype, device=dev).double()
    x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    w = torch.randn(*shape, dim, generator=g, dtype=dtype, device=dev).double()
    y = (x @ w.unsqueeze(-1)).squeeze(-1)
    if tau > 0:
        y = y + tau * torch.randn(*shape, context + 1, generator=g, dtype=dtype, device=dev).double()
    return x, y


def prompts_by_id(
    seed: int, stream: int, ids: Tensor, context: int, dim: int, tau: float, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Prompts with the given ids; prompt k depends only on (seed, stream, k).

    ``device`` (the device code path): drawn there, block by block, from :func:`device_generator`
    of the same keys; on the CPU that is the host path's draw exactly, on a GPU another one.
    """
    dev = torch.device("cpu" if device is None else device)
    ids = ids.to(dev, torch.int64)
    n = int(ids.shape[0])
    x = torch.empty(n, context + 1, dim, dtype=torch.float64, device=dev)
    y = torch.empty(n, context + 1, dtype=torch.float64, device=dev)
    blocks = ids // BLOCK
    for blk in torch.unique(blocks).tolist():
        g = generator(seed, stream, blk) if device is None else device_generator(seed, stream, blk, device=dev)
        bx, by = _draw(g, (BLOCK,), context, dim, tau, torch.float64)
        rows = (blocks == blk).nonzero().squeeze(1)
        local = ids[rows] - blk * BLOCK
        x[rows], y[rows] = bx[local], by[local]
    return x, y


def prompt_batch(g: torch.Generator, reps: int, n: int, context: int, dim: int, tau: float) -> tuple[Tensor, Tensor]:
    """(reps, n) independent prompts from one generator: x (reps, n, L+1, D), y (reps, n, L+1)."""
    return _draw(g, (reps, n), context, dim, tau, torch.float32)
