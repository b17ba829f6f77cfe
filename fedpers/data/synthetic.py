"""Synthetic data of SPEC §1, generated in fixed blocks of users so any node can make its own slice.

User j's data depends only on (seed, j): a node holding users [a, b) generates exactly
the rows the local runtime would, which is what makes runtimes comparable seed for seed.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

Tensor = torch.Tensor
BLOCK = 1024
_STREAM_TRUTH, _STREAM_USERS = 1, 2


def _generator(seed: int, *key: int) -> torch.Generator:
    state = np.random.SeedSequence([int(seed), *map(int, key)]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def subspace(seed: int, dim: int, rank: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """U* ∈ R^{d×k}, orthonormal, uniformly random."""
    g = _generator(seed, _STREAM_TRUTH)
    q, r = torch.linalg.qr(torch.randn(dim, rank, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


_BLOCKS: "OrderedDict[tuple[int, ...], tuple[Tensor, Tensor, Tensor]]" = OrderedDict()
BLOCK_CACHE_BYTES = 256 << 20
"""Most bytes of generated user blocks one process keeps (only blocks asked for in part)."""


def _user_block(seed: int, blk: int, samples: int, d: int, k: int, partial: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(x, v*, noise) of the BLOCK users of block ``blk``. A block asked for in part (a Flower
    node of a few users) is kept: the next node in this process from the same block — in a
    Ray simulation any actor serves any node — slices it instead of generating 1,024 users again."""
    key = (int(seed), int(blk), samples, d, k)
    if key in _BLOCKS:
        _BLOCKS.move_to_end(key)
        return _BLOCKS[key]
    g = _generator(seed, _STREAM_USERS, blk)
    bx = torch.randn(BLOCK, samples, d, generator=g, dtype=torch.float64)
    bv = torch.randn(BLOCK, k, generator=g, dtype=torch.float64)
    bz = torch.randn(BLOCK, samples, generator=g, dtype=torch.float64)
    if partial and bx.numel() * 8 <= BLOCK_CACHE_BYTES:
        _BLOCKS[key] = (bx, bv, bz)
        while sum(t.numel() * 8 for b in _BLOCKS.values() for t in b) > BLOCK_CACHE_BYTES:
            _BLOCKS.popitem(last=False)
    return bx, bv, bz


def altmin_users(
    seed: int,
    ids: Tensor,
    u_star: Tensor,
    samples: int,
    noise_std: float,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor]:
    """x_ij ~ N(0, I_d), v*_j ~ N(0, I_k), y_ij = <U*ᵀx_ij, v*_j> + N(0, σ_F²) for the given user ids."""
    ids = ids.to("cpu", torch.int64)
    d, k = u_star.shape
    n = int(ids.shape[0])
    x = torch.empty(n, samples, d, dtype=dtype)
    y = torch.empty(n, samples, dtype=dtype)
    v = torch.empty(n, k, dtype=dtype)
    if n == 0:
        return {"ids": ids, "x": x, "y": y, "v_star": v}
    blocks = ids // BLOCK
    u64 = u_star.to(torch.float64)
    for blk in torch.unique(blocks).tolist():
        rows = (blocks == blk).nonzero().squeeze(1)
        bx, bv, bz = _user_block(seed, blk, samples, d, k, partial=rows.numel() < BLOCK)
        local = ids[rows] - blk * BLOCK
        bx, bv, bz = bx[local], bv[local], bz[local]
        x[rows] = bx.to(dtype)
        v[rows] = bv.to(dtype)
        y[rows] = ((bx @ u64) @ bv.unsqueeze(-1)).squeeze(-1).add(noise_std * bz).to(dtype)
    return {"ids": ids, "x": x, "y": y, "v_star": v}
