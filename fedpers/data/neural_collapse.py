"""Synthetic neural-collapse features (docs/algorithms.md §3), generated per example id so any node can build its own slice.

Class k's feature under perfect collapse is the ETF column
``M_k``, ``M = sqrt(K/(K−1)) P (I_K − 11ᵀ/K)`` with ``PᵀP = I_K`` (so ``||M_k|| = 1``).
Perturbations: a fixed offset ``v`` (the same for every example, ``v = ±β`` per coordinate,
signs drawn once), or a random ``±β`` per coordinate per example. Class sizes follow
``π_k ∝ α^{k/(K−1)}`` (α = 1 balanced; α is the smallest/largest class ratio); examples are
laid out class by class, so example ``i``'s label is a function of ``i`` alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedpers.configs.noisygd import Collapse
from fedpers.data.synthetic import _generator

Tensor = torch.Tensor
BLOCK = 1024
_STREAM_ETF, _STREAM_OFFSET, _STREAM_TRAIN, _STREAM_TEST, _STREAM_TEST_PERTURBATION = 11, 12, 13, 14, 15


def etf(
    seed: int, classes: int, dim: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> Tensor:
    """The simplex ETF M ∈ R^{p×K} with a random partial orthogonal P (needs p ≥ K).

    ``device`` (the device code path): drawn there from a generator of the same key (on the CPU
    the host's M exactly; on a GPU another random P)."""
    if dim < classes:
        raise ValueError(f"feature_dim must be >= classes={classes} for a K-simplex ETF; got {dim}")
    dev = torch.device("cpu" if device is None else device)
    g = _generator(seed, _STREAM_ETF) if device is None else _generator(seed, _STREAM_ETF, device=dev)
    q, r = torch.linalg.qr(torch.randn(dim, classes, generator=g, dtype=torch.float64, device=dev))
    q = q * torch.sign(torch.diagonal(r))
    centre = torch.eye(classes, dtype=torch.float64, device=dev) - 1.0 / classes
    return (math.sqrt(classes / (classes - 1)) * q @ centre).to(dtype)


def class_counts(n: int, classes: int, imbalance: float) -> Tensor:
    """Exact class sizes summing to n with proportions ∝ α^{k/(K−1)} (largest remainders)."""
    w = np.array([imbalance ** (k / (classes - 1)) for k in range(classes)], dtype=np.float64)
    share = n * w / w.sum()
    counts = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - counts), kind="stable")
    counts[order[: n - counts.sum()]] += 1
    return torch.from_numpy(counts)


def labels_of(ids: Tensor, counts: Tensor) -> Tensor:
    """Label of each example id when examples are laid out class by class."""
    bounds = torch.cumsum(counts, 0)
    return torch.searchsorted(bounds, ids.to(torch.int64), right=True)


def offset_vector(
    seed: int, dim: int, beta: float, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> Tensor:
    dev = torch.device("cpu" if device is None else device)
    g = _generator(seed, _STREAM_OFFSET) if device is None else _generator(seed, _STREAM_OFFSET, device=dev)
    return (beta * (2 * torch.randint(0, 2, (dim,), generator=g, device=dev) - 1)).to(dtype)


def random_signs(
    seed: int,
    stream: int,
    ids: Tensor,
    dim: int,
    beta: float,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> Tensor:
    """±β per coordinate for each id, from fixed blocks of ids (a node's slice matches the whole);
    with ``device``, each block drawn there from a generator of the same key."""
    dev = torch.device("cpu" if device is None else device)
    ids = ids.to(dev, torch.int64)
    out = torch.empty(int(ids.shape[0]), dim, dtype=dtype, device=dev)
    blocks = ids // BLOCK
    for blk in torch.unique(blocks).tolist():
        g = _generator(seed, stream, blk) if device is None else _generator(seed, stream, blk, device=dev)
        signs = 2 * torch.randint(0, 2, (BLOCK, dim), generator=g, dtype=torch.int8, device=dev) - 1
        rows = (blocks == blk).nonzero().squeeze(1)
        out[rows] = beta * signs[ids[rows] - blk * BLOCK].to(dtype)
    return out


def features(
    seed: int,
    ids: Tensor,
    *,
    classes: int,
    dim: int,
    examples: int,
    collapse: Collapse,
    beta: float,
    imbalance: float,
    dtype: torch.dtype = torch.float64,
    test: bool = False,
    test_perturbation: float = 0.0,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """x (len(ids), p) and integer labels y for the given example ids (training, or a test set of size ``examples``).

    ``device`` (the device code path): everything drawn there, from generators of the same keys
    (on the CPU the host's features exactly)."""
    dev = torch.device("cpu" if device is None else device)
    ids = ids.to(dev, torch.int64)
    y = labels_of(ids, class_counts(examples, classes, imbalance).to(dev))
    M = etf(seed, classes, dim, dtype, device)
    x = M.T[y].clone()
    if collapse is Collapse.OFFSET:
        x += offset_vector(seed, dim, beta, dtype, device)
    elif collapse is Collapse.RANDOM:
        x += random_signs(seed, _STREAM_TEST if test else _STREAM_TRAIN, ids, dim, beta, dtype, device)
    if test and test_perturbation > 0:
        x += random_signs(seed, _STREAM_TEST_PERTURBATION, ids, dim, test_perturbation, dtype, device)
    return {"ids": ids, "x": x, "y": y}
