"""Pure, batched linear algebra used by the protocols.

Every function works on a leading batch of units, on any device, and never
draws randomness: noise belongs to :mod:`fedpers.privacy`.
"""
from __future__ import annotations

import math

from typing import Any

import torch

Tensor = torch.Tensor


def clip_factor(norms: Tensor, bound: float) -> Tensor:
    """min(1, bound / norm), equal to 1 where the norm is zero (no division by zero)."""
    if math.isinf(bound):
        return torch.ones_like(norms)
    return torch.where(norms > bound, bound / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.ones_like(norms))


def pow2_scale(x: Tensor, dims: int = 1) -> Tensor:
    """A power of two per leading index with max|x|/scale in [1, 2): dividing by it is exact.

    1 where the block is zero or non-finite (a non-finite block stays non-finite, for the
    per-unit rule of :func:`fedpers.protocols.base.client_message` to catch).
    """
    peak = x.flatten(start_dim=x.dim() - dims).abs().amax(-1) if x.numel() else x.new_zeros(x.shape[: x.dim() - dims])
    _, exponent = torch.frexp(peak)
    scale = torch.ldexp(torch.ones_like(peak), exponent - 1)  # ≤ peak, so representable
    return torch.where((peak > 0) & torch.isfinite(peak), scale, torch.ones_like(peak))


SAFE_RANGE = (2.0**-40, 2.0**40)
"""Magnitudes whose squares, summed over any realistic dimension, neither overflow nor lose
precision to underflow in float32: data inside needs no rescaling."""


def in_safe_range(x: Tensor) -> bool:
    """True when every entry is zero or has a magnitude in :data:`SAFE_RANGE` (one pass)."""
    if x.numel() == 0:
        return True
    a = x.abs()
    peak = float(a.amax())
    if not peak <= SAFE_RANGE[1]:  # also false for NaN/inf
        return False
    low = float(torch.where(a > 0, a, torch.full_like(a, math.inf)).amin())
    return low >= SAFE_RANGE[0]


def safe_norms(x: Tensor) -> Tensor | None:
    """Euclidean norms over the last dim, or None when they cannot be trusted as computed.

    Trusted: every norm finite and ≤ 2⁴⁰, and every norm < 2⁻⁴⁰ exactly zero on a vector
    that is exactly zero (a sum of squares ≥ 2⁻⁸⁰ loses nothing to underflow, even in float32;
    one that underflowed to 0 is caught). One pass over x plus passes over the norms — about
    4× cheaper than checking every entry with :func:`in_safe_range`.
    """
    if x.numel() == 0:
        return torch.linalg.vector_norm(x, dim=-1)
    norm = torch.linalg.vector_norm(x, dim=-1)
    if not float(norm.amax()) <= SAFE_RANGE[1]:  # also false for NaN/inf
        return None
    small = norm < SAFE_RANGE[0]
    if bool(small.any()) and (bool((norm[small] > 0).any()) or float(x[small].abs().amax()) > 0):
        return None
    return norm


def directions(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x/||x||, log||x||) over the last dim without overflow or underflow, for any finite x.

    Zero vectors give (0, −inf). ``log||x||`` is float64 so products of norms can be formed
    as sums of logs (see :func:`clipped_magnitude`) whatever the working dtype. Vectors whose
    norms are :func:`safe_norms` skip the exact power-of-two rescaling.
    """
    norm = safe_norms(x)
    if norm is not None:
        unit = x / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
        return unit, norm.double().log()
    scale = pow2_scale(x)
    scaled = x / scale.unsqueeze(-1)
    norm = torch.linalg.vector_norm(scaled, dim=-1)
    unit = scaled / torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
    return unit, norm.double().log() + scale.double().log()


def clipped_magnitude(log_norm: Tensor, bound: float) -> Tensor:
    """min(exp(log_norm), bound) in float64: the norm of a vector after clipping it to ``bound``,
    given its log-norm (−inf for zero). A clip factor times a norm never overflows this way."""
    return log_norm.clamp(max=math.log(bound)).exp() if math.isfinite(bound) else log_norm.exp()


def clip_vectors(x: Tensor, bound: float, dims: int = 1) -> Tensor:
    """Clip each vector (or matrix, ``dims`` trailing dims, Frobenius norm) to norm ``bound``.

    Norms are taken after an exact power-of-two scaling, so a huge finite x is clipped to
    norm ``bound`` (not to 0 or NaN by an overflowing norm); otherwise bit-for-bit
    x·min(1, bound/||x||).
    """
    if math.isinf(bound):
        return x
    lead = x.shape[: x.dim() - dims]
    flat = x.reshape(*lead, -1)
    scale = pow2_scale(flat)
    scaled = flat / scale.unsqueeze(-1)
    norm = torch.linalg.vector_norm(scaled, dim=-1)
    factor = torch.where(norm * scale > bound, bound / norm.clamp_min(torch.finfo(norm.dtype).tiny), scale)
    return (scaled * factor.unsqueeze(-1)).reshape(x.shape)


def clip_scalar(y: Tensor, bound: float) -> Tensor:
    """max(-c, min(c, y))."""
    if math.isinf(bound):
        return y
    return y.clamp(-bound, bound)


def sym(w: Tensor) -> Tensor:
    """(W + Wᵀ)/2 over the last two dims; keeps ||sym(W)||_F ≤ ||W||_F."""
    return (w + w.transpose(-1, -2)) / 2


def batched_ridge_solve(features: Tensor, targets: Tensor, ridge: float) -> Tensor:
    """argmin_v ||features v - targets||² + ridge ||v||², batched.

    features (..., m, k), targets (..., m) -> (..., k). The ridge is only for numerical
    safety; it is scaled by the mean diagonal of the Gram matrix so it is unit-free.
    A problem with non-finite entries gets a NaN solution (never an exception), so the
    per-unit rule can set that unit aside.
    """
    # the products in the working dtype, the k×k systems in float64 (cheap; float32 Grams of
    # nearly collinear features lose the solve otherwise)
    gram = (features.transpose(-1, -2) @ features).double()
    k = gram.shape[-1]
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).clamp_min(1.0)
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    gram = gram + (ridge * scale).unsqueeze(-1) * eye
    rhs = (features.transpose(-1, -2) @ targets.unsqueeze(-1)).squeeze(-1).double()
    bad = ~(torch.isfinite(gram).flatten(-2).all(-1) & torch.isfinite(rhs).all(-1))
    if bool(bad.any()):
        gram = torch.where(bad[..., None, None], eye, gram)
        rhs = torch.where(bad[..., None], torch.full_like(rhs, math.nan), rhs)
    chol, info = torch.linalg.cholesky_ex(gram)
    if bool((info == 0).all()):
        return torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1).to(features.dtype)
    return torch.linalg.lstsq(gram, rhs.unsqueeze(-1)).solution.squeeze(-1).to(features.dtype)


def kron_vvT_sum(v: Tensor, s: Tensor) -> Tensor:
    """Σ_j (v_j v_jᵀ) ⊗ S_j as a (dk, dk) matrix without forming any per-unit Kronecker product.

    v (n, k), s (n, d, d). Index (a, p) of the result is a·d + p, which matches
    column-stacking vec(x vᵀ) = v ⊗ x.
    """
    n, k = v.shape
    d = s.shape[-1]
    vv = (v.unsqueeze(-1) * v.unsqueeze(-2)).reshape(n, k * k)
    blocks = (vv.transpose(0, 1) @ s.reshape(n, d * d)).reshape(k, k, d, d)
    return blocks.permute(0, 2, 1, 3).reshape(k * d, k * d)


def pair_statistic(x: Tensor, y: Tensor, label_clip: float = math.inf) -> Tensor:
    """Σ_users Σ_pairs sym(x̂_a x̂_bᵀ clip(y_a) clip(y_b)) over consecutive sample pairs (a, b) = (2i, 2i+1).

    x (users, 2p, d), y (users, 2p). x̂ = x/||x|| (0 for x = 0) is formed without overflow, so
    each pair's term has Frobenius norm ≤ ζ² for every finite input (the private
    initialisation's statistic, Algorithm 3 of the personalization paper).
    """
    d = x.shape[-1]
    xa, _ = directions(x[:, 0::2])
    xb, _ = directions(x[:, 1::2])
    coef = clip_scalar(y[:, 0::2], label_clip) * clip_scalar(y[:, 1::2], label_clip)
    return sym((xa * coef.unsqueeze(-1)).reshape(-1, d).transpose(0, 1) @ xb.reshape(-1, d))


def kron_gram_sum(v: Tensor, x: Tensor, block: int = 48) -> Tensor:
    """Σ_j (v_j v_jᵀ) ⊗ (X_jᵀ X_j) as a (dk, dk) matrix, fused per block of units.

    v (n, k), x (n, q, d). Each block's X_jᵀX_j (block, d, d) is consumed right away by one
    GEMM with the k(k+1)/2 products v_a v_b (a ≤ b; the rest by symmetry), so the n·d² Gram
    matrices never go through main memory at once: about 2× faster than forming them all and
    then calling :func:`kron_vvT_sum` (benchmarks/altmin_round.py). Same index layout.

    The block products are too small for torch's own threads (with two threads on two busy
    cores they collapse), so on the CPU the users are cut into up to :data:`KRON_STREAMS`
    contiguous shares, each a single-threaded stream on one of torch's threads, and the partial
    sums are added in a fixed order: 1.3–1.8× faster on two idle cores, and the same bits
    whatever the thread count.
    """
    n, q, d = x.shape
    k = v.shape[-1]
    rows, cols = torch.triu_indices(k, k, device=v.device)
    vv = v[:, rows] * v[:, cols]

    def blocks_of(lo: int, hi: int) -> Tensor:
        acc = torch.zeros(rows.shape[0], d * d, dtype=x.dtype, device=x.device)
        for start in range(lo, hi, block):
            stop = min(start + block, hi)
            xb = x[start:stop]
            acc.addmm_(vv[start:stop].transpose(0, 1), torch.bmm(xb.transpose(1, 2), xb).reshape(-1, d * d))
        return acc

    threads = torch.get_num_threads()
    if x.device.type != "cpu":
        blocks = blocks_of(0, n)
    else:
        # the split depends on n only (never on the thread count), so the sum is the same bits
        # in every process: a resumed run, a Ray worker and the local runtime agree exactly
        parts = max(1, min(KRON_STREAMS, n // (2 * block)))
        bounds = [round(n * i / parts / block) * block for i in range(parts)] + [n]
        torch.set_num_threads(1)
        try:
            if parts == 1:
                blocks = blocks_of(0, n)
            else:
                shares = list(_pool(max(1, min(parts, threads))).map(lambda i: blocks_of(bounds[i], bounds[i + 1]), range(parts)))
                blocks = shares[0]
                for share in shares[1:]:
                    blocks += share
        finally:
            torch.set_num_threads(threads)
    full = torch.empty(k, k, d, d, dtype=x.dtype, device=x.device)
    blocks = blocks.reshape(-1, d, d)
    full[rows, cols] = blocks
    full[cols, rows] = blocks.transpose(-1, -2)
    return full.permute(0, 2, 1, 3).reshape(k * d, k * d)


KRON_STREAMS = 4
"""Contiguous shares of the users in :func:`kron_gram_sum` (run on up to that many threads)."""

_POOLS: dict[int, Any] = {}


def _pool(workers: int) -> Any:
    """A thread pool per size, kept for the process (torch ops release the GIL)."""
    if workers not in _POOLS:
        from concurrent.futures import ThreadPoolExecutor

        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="fedpers-kron")
    return _POOLS[workers]


def vec_to_matrix(u: Tensor, d: int, k: int) -> Tensor:
    """Inverse of column-stacking vec: (dk,) -> (d, k)."""
    return u.reshape(k, d).transpose(0, 1)


def orthonormal_basis(u: Tensor) -> Tensor:
    """Q of the thin QR of u (d, k), with signs fixed so diag(R) ≥ 0 (deterministic)."""
    q, r = torch.linalg.qr(u)
    signs = torch.sign(torch.diagonal(r))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs


def top_eigenvectors(m: Tensor, k: int) -> Tensor:
    """Eigenvectors of the k largest eigenvalues of a symmetric matrix, as a (d, k) orthonormal basis."""
    _, vecs = torch.linalg.eigh(sym(m))
    return vecs[:, -k:].flip(-1)


def psd_eigen_floor(a: Tensor, floor: float) -> tuple[Tensor, int]:
    """Raise every eigenvalue of symmetric ``a`` to at least ``floor``; returns (matrix, how many raised)."""
    vals, vecs = torch.linalg.eigh(sym(a))
    raised = int((vals < floor).sum())
    vals = vals.clamp_min(floor)
    return (vecs * vals) @ vecs.transpose(0, 1), raised
