"""Pure, batched linear algebra used by the protocols.

Every function works on a leading batch of units, on any device, and never
draws randomness: noise belongs to :mod:`fedpers.privacy`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import overload

import torch

from fedpers.devices import pending

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
    if _untrusted(x, norm):
        return None
    return norm


def _untrusted(x: Tensor, norm: Tensor) -> bool:
    """Whether some norm of x (non-empty) is above 2⁴⁰ or non-finite, or below 2⁻⁴⁰ without
    being exactly 0 on a zero vector: one host read of the norms' minimum and maximum, and a
    closer look only where the minimum is below 2⁻⁴⁰ (a NaN makes both NaN: refused first).

    With checks deferred (:func:`fedpers.devices.pending`) nothing is read: the same decision is
    recorded on the device and the norms are taken as trusted (a round where they were not is made
    again with the checks read)."""
    checks = pending()
    if checks is not None:
        small = norm < SAFE_RANGE[0]
        # as below: a small norm is trusted only if it is exactly 0 on a vector that is exactly 0
        bad_small = (small & ((norm > 0) | (torch.linalg.vector_norm(x, ord=math.inf, dim=-1) > 0))).any()
        checks.expect((norm.amax() <= SAFE_RANGE[1]) & ~bad_small)
        return False
    low, peak = torch.stack(torch.aminmax(norm)).tolist()  # one host read
    if not peak <= SAFE_RANGE[1]:  # also false for NaN/inf
        return True
    if low < SAFE_RANGE[0]:  # some norm may be small, as the norms' dtype compares it
        small = norm < SAFE_RANGE[0]
        if bool(small.any()) and (bool((norm[small] > 0).any()) or float(x[small].abs().amax()) > 0):
            return True
    return False


ROW_BLOCK = 4096
"""Rows per block of :func:`row_products` (bounds its (rows, k, d) temporary)."""


def row_products(x: Tensor, W: Tensor) -> Tensor:
    """x @ Wᵀ for x (n, d), W (k, d), each row's bits independent of n: a matrix product's kernel depends
    on its shape (one row takes another summation order than many), so a unit's products alone and in a
    batch would differ in the last bit; an elementwise product summed over d does not."""
    if x.shape[0] <= ROW_BLOCK:
        return (x.unsqueeze(1) * W.unsqueeze(0)).sum(-1)
    return torch.cat([row_products(x[i : i + ROW_BLOCK], W) for i in range(0, x.shape[0], ROW_BLOCK)])


def trusted_rows(x: Tensor) -> Tensor:
    """(U,) bool: for each unit x[j] (leading dim), whether :func:`safe_norms` would trust the norms over
    its last dim were it called on x[j] alone — the decision each unit's own ``client_update`` takes, so
    a batch computes the trusted units as each would alone and leaves the others to be computed alone."""
    units = x.shape[0]
    if units == 0:
        return torch.ones(0, dtype=torch.bool, device=x.device)
    norm = torch.linalg.vector_norm(x, dim=-1).reshape(units, -1)
    if norm.shape[1] == 0:
        return torch.ones(units, dtype=torch.bool, device=x.device)
    ok = (norm <= SAFE_RANGE[1]).all(1)  # also false for NaN/inf
    small = norm < SAFE_RANGE[0]
    nonzero = x.abs().amax(-1).reshape(units, -1) > 0 if x.shape[-1] else torch.zeros_like(small)
    return ok & ~(small & ((norm > 0) | nonzero)).any(1)


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
    """argmin_v ||features v - targets||² + ridge ||v||², batched (see :func:`_ridge_solve`);
    many small problems, so single-threaded per share of the batch (:func:`small_batched`)."""
    if features.dim() < 3 or features.shape[0] < 512:
        return _ridge_solve(features, targets, ridge)
    return small_batched(lambda f, t: _ridge_solve(f, t, ridge), features, targets, min_share=256)


def _ridge_solve(features: Tensor, targets: Tensor, ridge: float) -> Tensor:
    """argmin_v ||features v - targets||² + ridge ||v||², batched.

    features (..., m, k), targets (..., m) -> (..., k). The ridge is only for numerical
    safety; it is scaled by the mean diagonal of the Gram matrix so it is unit-free.
    A problem with non-finite entries gets a NaN solution (never an exception), so the
    per-unit rule can set that unit aside.
    """
    # the products in the working dtype, the k×k systems in float64 (cheap; float32 Grams of
    # nearly collinear features lose the solve otherwise)
    ft = features.transpose(-1, -2)
    gram = (ft @ features).double()
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    # the ridge on the diagonal in place: off it, adding ridge·scale·0 changed nothing (a non-finite
    # scale comes from a non-finite diagonal, and such a problem is replaced below either way)
    diagonal.add_(ridge * diagonal.mean(-1, keepdim=True).clamp_min(1.0))
    rhs = (ft @ targets.unsqueeze(-1)).squeeze(-1).double()
    # on the host one read decides whether any problem is non-finite (then each is found); on a GPU
    # the where costs less than reading anything
    if gram.device.type != "cpu" or not bool(torch.isfinite(gram).all() & torch.isfinite(rhs).all()):
        bad = ~(torch.isfinite(gram).flatten(-2).all(-1) & torch.isfinite(rhs).all(-1))
        gram = torch.where(bad[..., None, None], torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device), gram)
        rhs = torch.where(bad[..., None], torch.full_like(rhs, math.nan), rhs)
    chol, info = torch.linalg.cholesky_ex(gram)
    out = torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
    checks = pending()
    if checks is not None:  # no failure, or the round is made again with this read
        checks.expect((info == 0).all())
        return out.to(features.dtype)
    failed = (info != 0).nonzero(as_tuple=True)
    if failed[0].numel():  # per problem, so the answer never depends on its batch-mates
        out[failed] = lstsq_rank_revealing(gram[failed], rhs[failed].unsqueeze(-1)).squeeze(-1)
    return out.to(features.dtype)


def lstsq(a: Tensor, b: Tensor) -> Tensor:
    """The least-squares solution of a x = b (batched), the same bits on every call with the same
    input. On the CPU LAPACK's ``gelsd`` (SVD: the minimum-norm solution, rank revealed): torch's
    default there, ``gelsy``, gave other bits on 940 of 1,000 repeated calls on one full-rank
    input here, and the zero vector instead of the minimum-norm solution of a rank-one system in
    about 2 % of calls, as the process's memory changed between calls. Elsewhere the device's own
    driver (CUDA has ``gels`` only: full rank)."""
    if a.device.type == "cpu":
        return torch.linalg.lstsq(a, b, driver="gelsd").solution
    return torch.linalg.lstsq(a, b).solution


def lstsq_rank_revealing(a: Tensor, b: Tensor) -> Tensor:
    """Least squares of the few systems a Cholesky refused (near-singular), on the host: CUDA's
    ``lstsq`` has only the ``gels`` driver, which assumes full rank — exactly what these systems
    lack — while the CPU's :func:`lstsq` reveals the rank. A no-op move on the CPU."""
    return lstsq(a.cpu(), b.cpu()).to(a.device)


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


def pair_statistic(
    x: Tensor, y: Tensor, label_clip: float = math.inf, block: int = 64, *, device_kernels: bool = False
) -> Tensor:
    """Σ_users Σ_pairs sym(x̂_a x̂_bᵀ clip(y_a) clip(y_b)) over consecutive sample pairs (a, b) = (2i, 2i+1).

    x (users, 2p, d), y (users, 2p). x̂ = x/||x|| (0 for x = 0) is formed without overflow, so
    each pair's term has Frobenius norm ≤ ζ² for every finite input (the private
    initialisation's statistic, Algorithm 3 of the personalization paper).

    The norms of a share in one pass, then per block of users in cache one GEMM
    Σ (w_i x_a,i) x_b,iᵀ with w_i = clip(y_a) clip(y_b)/(||x_a|| ||x_b||), so no unit vector is
    ever written out. A block whose norms are not :func:`safe_norms`-safe takes the exact
    :func:`directions` path. ``device_kernels``: blocks of :data:`DEVICE_BLOCK` users, one
    stream (a few large kernels per chunk, for a GPU; see :func:`kron_statistics`).
    """
    d = x.shape[-1]
    if device_kernels:
        block = max(block, DEVICE_BLOCK)
    coef = clip_scalar(y[:, 0::2], label_clip) * clip_scalar(y[:, 1::2], label_clip)

    def share_weights(lo: int, hi: int) -> Tensor | None:
        """The pair weights of a whole share at once, or None where some norm is not trusted."""
        na, nb = _block_norms(x[lo:hi, 0::2]), _block_norms(x[lo:hi, 1::2])
        if na is None or nb is None:
            return None
        c = coef[lo:hi]
        return torch.where((na > 0) & (nb > 0), c / (na * nb).clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(c))

    def blocks_of(lo: int, hi: int) -> tuple[Tensor]:
        acc = torch.zeros(d, d, dtype=x.dtype, device=x.device)
        weights = share_weights(lo, hi)
        for start in range(lo, hi, block):
            stop = min(start + block, hi)
            xa, xb, c = x[start:stop, 0::2], x[start:stop, 1::2], coef[start:stop]
            if weights is not None:
                acc.addmm_(
                    (xa * weights[start - lo : stop - lo].unsqueeze(-1)).reshape(-1, d).transpose(0, 1),
                    xb.reshape(-1, d),
                )
                continue
            na, nb = _block_norms(xa), _block_norms(xb)
            if na is not None and nb is not None:
                w = torch.where(
                    (na > 0) & (nb > 0), c / (na * nb).clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(c)
                )
            else:
                xa, _ = directions(xa)
                xb, _ = directions(xb)
                w = c
            acc.addmm_((xa * w.unsqueeze(-1)).reshape(-1, d).transpose(0, 1), xb.reshape(-1, d))
        return (acc,)

    (total,) = _stream_sum(x.shape[0], block, blocks_of, x.device, one_stream=device_kernels)
    return sym(total)


def pair_statistics(x: Tensor, y: Tensor, label_clip: float = math.inf) -> Tensor:
    """:func:`pair_statistic` of each unit alone, (U, d, d): what it returns for x[j : j + 1] when that
    unit's norms are trusted (:func:`trusted_rows` of x[:, 0::2] and x[:, 1::2]; the caller computes the
    others alone), the same ops on a batch (per-unit weights, one batched product, :func:`sym`)."""
    coef = clip_scalar(y[:, 0::2], label_clip) * clip_scalar(y[:, 1::2], label_clip)
    xa, xb = x[:, 0::2], x[:, 1::2]
    na, nb = torch.linalg.vector_norm(xa, dim=-1), torch.linalg.vector_norm(xb, dim=-1)
    w = torch.where((na > 0) & (nb > 0), coef / (na * nb).clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(coef))
    return sym(torch.bmm((xa * w.unsqueeze(-1)).transpose(1, 2), xb))


def _block_norms(x: Tensor) -> Tensor | None:
    """Norms over the last dim (one pass, strided x read in place), or None where
    :func:`safe_norms` would not trust them: some norm above 2⁴⁰ (or non-finite), below 2⁻⁴⁰
    without being exactly 0, or 0 on a vector that is not zero (its squares underflowed)."""
    if x.numel() == 0:
        return x.new_zeros(x.shape[:-1])
    norm = torch.linalg.vector_norm(x, dim=-1)  # reads a strided x in place (an einsum copies it first)
    return None if _untrusted(x, norm) else norm


def kron_gram_sum(v: Tensor, x: Tensor, block: int | None = None) -> Tensor:
    """Σ_j (v_j v_jᵀ) ⊗ (X_jᵀ X_j) as a (dk, dk) matrix, fused per block of units (see
    :func:`kron_statistics`, which this is without clipping or labels)."""
    return kron_statistics(v, x, block=block)[0]


@overload
def kron_statistics(
    v: Tensor,
    x: Tensor,
    log_v: Tensor | None = None,
    eta: float = math.inf,
    label: None = None,
    block: int | None = None,
    *,
    device_kernels: bool = False,
) -> tuple[Tensor, None]: ...
@overload
def kron_statistics(
    v: Tensor,
    x: Tensor,
    log_v: Tensor | None,
    eta: float,
    label: Tensor,
    block: int | None = None,
    *,
    device_kernels: bool = False,
) -> tuple[Tensor, Tensor]: ...
@overload
def kron_statistics(
    v: Tensor,
    x: Tensor,
    log_v: Tensor | None = None,
    eta: float = math.inf,
    *,
    label: Tensor,
    block: int | None = None,
    device_kernels: bool = False,
) -> tuple[Tensor, Tensor]: ...
def kron_statistics(
    v: Tensor,
    x: Tensor,
    log_v: Tensor | None = None,
    eta: float = math.inf,
    label: Tensor | None = None,
    block: int | None = None,
    *,
    device_kernels: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(Σ_j (v_j v_jᵀ) ⊗ (Σ_i x̃_ij x̃_ijᵀ), Σ_j v_j ⊗ Σ_i label_ij x̃_ij) as ((dk, dk), (dk,) or None).

    v (n, k), x (n, q, d), label (n, q). With ``log_v`` (n,) given, x̃_ij = x_ij·min(||v_j||, η/||x_ij||)
    (0 for x_ij = 0): w_ij = clip(||v_j|| x̂_j ⊗ x_ij; η) = v̂_j ⊗ x̃_ij, the clipped AltMin
    contribution (``v`` then holds the directions v̂_j); without it x̃ = x. Index (a, p) of the
    result is a·d + p, which matches column-stacking vec(x vᵀ) = v ⊗ x.

    Each block's scaling and Gram matrices X̃_jᵀX̃_j happen in cache and are consumed right away
    by a GEMM with the k(k+1)/2 products v_a v_b (a ≤ b; the rest by symmetry), so the n·d² Gram
    matrices never go through main memory: about 2× faster than forming them all
    (benchmarks/altmin_round.py). On the host only the Gram rows [:d//2] and the lower-right
    (d − d//2)² block are formed (G21 = G12ᵀ: 3/4 of the flops), and the label sums are one
    batched product per share. The norms for the clip are one pass per share when
    :func:`_block_norms` trusts them, else each block takes the exact :func:`directions`.

    The block products are too small for torch's own threads, so on the CPU the users are cut
    into up to :data:`KRON_STREAMS` contiguous shares, each a single-threaded stream on one of
    torch's threads, and the partial sums are added in a fixed order: the same bits whatever
    the thread count.

    ``device_kernels`` (the device path, for a GPU; runs on any device): blocks of
    :data:`DEVICE_BLOCK` users in one stream, so a chunk is a few large batched kernels (one
    batched Gram, one GEMM per block) instead of a Python loop over blocks of :func:`kron_block` users.
    """
    n, _, d = x.shape
    block = kron_block(d, x.element_size()) if block is None else block
    if device_kernels:
        block = max(block, DEVICE_BLOCK)
    if n == 1 and not device_kernels:  # a node of one user, every round: a handful of ops
        one = _one_unit_statistics(v, x, log_v, eta, label)
        if one is not None:
            return one
    k = v.shape[-1]
    rows, cols = torch.triu_indices(k, k, device=v.device)
    vv = v[:, rows] * v[:, cols]
    v_norm = None if log_v is None else log_v.double().exp()  # inf beyond float64: then min(·) takes η/||x||

    def scaled(start: int, stop: int) -> Tensor:
        xb = x[start:stop]
        if log_v is None or v_norm is None:  # both or neither
            return xb
        norm = _block_norms(xb)
        if norm is not None:
            return xb * _clip_factors(norm, v_norm[start:stop].unsqueeze(-1), eta).to(x.dtype).unsqueeze(-1)
        x_hat, log_x = directions(xb)
        return x_hat * clipped_magnitude(log_v[start:stop].unsqueeze(-1) + log_x, eta).to(x.dtype).unsqueeze(-1)

    def share_factors(lo: int, hi: int) -> Tensor | None:
        """The clip factors min(||v_j||, η/||x_ij||) of a whole share at once (one pass for the
        norms, one for the factors), or None where some norm is not trusted (then per block)."""
        if v_norm is None:
            return None
        norm = _block_norms(x[lo:hi])
        if norm is None:
            return None
        return _clip_factors(norm, v_norm[lo:hi].unsqueeze(-1), eta).to(x.dtype).unsqueeze(-1)

    h = d // 2  # x = [x_1 x_2] split at h: on the host the Gram's rows [:h] (G11 G12) and G22 are formed

    def device_blocks(lo: int, hi: int) -> tuple[Tensor, ...]:
        acc = torch.zeros(rows.shape[0], d * d, dtype=x.dtype, device=x.device)
        bacc = torch.zeros(k, d, dtype=x.dtype, device=x.device)
        factors = share_factors(lo, hi)
        for start in range(lo, hi, block):
            stop = min(start + block, hi)
            xb = scaled(start, stop) if factors is None else x[start:stop] * factors[start - lo : stop - lo]
            acc.addmm_(vv[start:stop].transpose(0, 1), torch.bmm(xb.transpose(1, 2), xb).reshape(-1, d * d))
            if label is not None:
                t = torch.bmm(label[start:stop].unsqueeze(1), xb).squeeze(1)
                bacc.addmm_(v[start:stop].transpose(0, 1), t)
        return (acc, bacc)

    def host_blocks(lo: int, hi: int) -> tuple[Tensor, ...]:
        """A share on the host, in three quarters of the flops: per block the rows [:h] of the Gram
        matrices (G11 G12) and their block G22 (G21 = G12ᵀ is never formed), each one GEMM with the
        products v_a v_b; blocks are scaled into and multiplied into reused buffers (no allocation).
        Where the clip factors are known (or none are needed) the label sums are one batched
        product over the share, Σ_i (label_ij·f_ij) x_ij, then one GEMM with v."""
        top = torch.zeros(rows.shape[0], h * d, dtype=x.dtype, device=x.device)
        low = torch.zeros(rows.shape[0], (d - h) ** 2, dtype=x.dtype, device=x.device)
        bacc = torch.zeros(k, d, dtype=x.dtype, device=x.device)
        factors = share_factors(lo, hi)
        whole = factors is not None or v_norm is None  # else each block's own norms and factors
        xs, vv_t = x[lo:hi], vv[lo:hi].transpose(0, 1)
        if label is not None and whole:
            w = label[lo:hi] if factors is None else label[lo:hi] * factors.squeeze(-1)
            bacc.addmm_(v[lo:hi].transpose(0, 1), torch.bmm(w.unsqueeze(1), xs).squeeze(1))
        buf = torch.empty(block if factors is not None else 0, *x.shape[1:], dtype=x.dtype, device=x.device)
        g_top = torch.empty(block, h, d, dtype=x.dtype, device=x.device)
        g_low = torch.empty(block, d - h, d - h, dtype=x.dtype, device=x.device)
        for start in range(0, hi - lo, block):
            stop = min(start + block, hi - lo)
            xb = xs[start:stop]
            if factors is not None:
                xb = torch.mul(xb, factors[start:stop], out=buf[: stop - start])
            elif not whole:
                xb = scaled(lo + start, lo + stop)
                if label is not None:
                    t = torch.bmm(label[lo + start : lo + stop].unsqueeze(1), xb).squeeze(1)
                    bacc.addmm_(v[lo + start : lo + stop].transpose(0, 1), t)
            xt = xb.transpose(1, 2)
            top.addmm_(vv_t[:, start:stop], torch.bmm(xt[:, :h], xb, out=g_top[: stop - start]).view(stop - start, -1))
            g = torch.bmm(xt[:, h:], xb[:, :, h:], out=g_low[: stop - start])
            low.addmm_(vv_t[:, start:stop], g.view(stop - start, -1))
        return (top, low, bacc)

    if device_kernels:
        blocks, bsum = _stream_sum(n, block, device_blocks, x.device, one_stream=True)
        grams = blocks.view(-1, d, d)
    else:
        top, low, bsum = _stream_sum(n, block, host_blocks, x.device)
        grams = torch.empty(rows.shape[0], d, d, dtype=x.dtype, device=x.device)
        upper = top.view(rows.shape[0], h, d)
        grams[:, :h] = upper
        grams[:, h:, :h] = upper[:, :, h:].transpose(1, 2)
        grams[:, h:, h:] = low.view(rows.shape[0], d - h, d - h)
    # block (a, b) of the result is rows a·d.., columns b·d..; (b, a) is its transpose, and a diagonal
    # block is the transpose of its sum (as an earlier index_put wrote it); plain slice copies
    full = torch.empty(k * d, k * d, dtype=x.dtype, device=x.device)
    pairs = [(a, b) for a in range(k) for b in range(a, k)]  # torch.triu_indices' order
    for (a, b), g in zip(pairs, grams):
        full[b * d : (b + 1) * d, a * d : (a + 1) * d] = g.transpose(0, 1)
        if a != b:
            full[a * d : (a + 1) * d, b * d : (b + 1) * d] = g
    return full, (bsum.reshape(k * d) if label is not None else None)


def _clip_factors(norm: Tensor, v_norm: Tensor, eta: float) -> Tensor:
    """min(||v_j||, η/||x_ij||) in float64 from trusted norms (0 where x_ij = 0): the factor that
    clips ||v_j|| x_ij to η, the same ops wherever kron_statistics forms it."""
    nd = norm.double()
    return torch.where(nd > 0, torch.minimum(v_norm, eta / nd.clamp_min(1e-300)), torch.zeros_like(nd))


def _one_unit_statistics(
    v: Tensor, x: Tensor, log_v: Tensor | None, eta: float, label: Tensor | None
) -> tuple[Tensor, Tensor | None] | None:
    """:func:`kron_statistics` of one unit (n = 1) in a few ops instead of the blocked path's
    dozens: X̃ᵀX̃ as one product, A = (v vᵀ) ⊗ X̃ᵀX̃ and b = v ⊗ Σ_i (label_i·f_i) x_i as Kronecker
    products. The clip factors f_i and the label sum are formed as the blocked path forms them
    (the same bits); the Gram's entries may be summed in another order (float rounding). None
    where :func:`_block_norms` does not trust the norms: the blocked path then takes the exact
    :func:`directions`, as it does for any n."""
    xb, w = x[0], None if label is None else label[0]
    if log_v is not None:
        norm = _block_norms(xb)
        if norm is None:
            return None
        vn = log_v[0].double().exp()  # inf beyond float64: then min(·) takes η/||x||
        factor = _clip_factors(norm, vn, eta).to(x.dtype)
        w = None if w is None else w * factor  # the label sum reads the unscaled x, as the blocked path's does
        scaled = xb * factor.unsqueeze(-1)
    else:
        scaled = xb
    A = torch.kron(torch.outer(v[0], v[0]), scaled.transpose(0, 1) @ scaled)
    return A, (None if w is None else torch.kron(v[0], w @ xb))


def kron_unit_statistics(v: Tensor, x: Tensor, log_v: Tensor, eta: float, label: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`kron_statistics` of each unit alone, ((U, dk, dk), (U, dk)): what it returns for unit j alone
    when x[j]'s norms are trusted (:func:`trusted_rows`; the caller computes the others alone), the ops of
    :func:`_one_unit_statistics` on a batch: clip factors, X̃ᵀX̃ as one batched product, A_j = (v_j v_jᵀ) ⊗
    X̃_jᵀX̃_j and b_j = v_j ⊗ Σ_i (label_ij·f_ij) x_ij as broadcast products."""
    n, _, d = x.shape
    k = v.shape[-1]
    norm = torch.linalg.vector_norm(x, dim=-1)
    factor = _clip_factors(norm, log_v.double().exp().unsqueeze(-1), eta).to(x.dtype)
    w = label * factor  # the label sum reads the unscaled x, as the blocked path's does
    scaled = x * factor.unsqueeze(-1)
    gram = torch.bmm(scaled.transpose(1, 2), scaled)
    outer = v.unsqueeze(-1) * v.unsqueeze(-2)
    A = torch.einsum("uab,uij->uaibj", outer, gram).reshape(n, k * d, k * d)  # one product an entry, as kron's
    t = torch.bmm(w.unsqueeze(1), x).squeeze(1)
    return A, torch.einsum("ua,ui->uai", v, t).reshape(n, k * d)


KRON_BLOCK = 48
"""Users per block of :func:`kron_statistics` where their Gram halves fit :data:`GRAM_CACHE`."""
GRAM_CACHE = 1 << 20
"""Bytes of one block's Gram halves that stay in a core's L2 cache between the batched products
that write them and the GEMMs that read them (1 MiB on the 2-core machine)."""


def kron_block(d: int, itemsize: int) -> int:
    """Users per :func:`kron_statistics` block: :data:`KRON_BLOCK`, or fewer (a multiple of 4, at
    least 8) where the parts of their Gram matrices that are formed (rows [:d//2] and the lower-right
    block: about 3d²/4 entries) would spill out of :data:`GRAM_CACHE` (d > 85 in float32, d > 60 in
    float64; at d = 100 it is 32 and 16). A function of d and the dtype alone, so every runtime sums
    the same blocks."""
    h = d // 2
    fits = GRAM_CACHE // ((h * d + (d - h) ** 2) * itemsize)
    return KRON_BLOCK if fits >= KRON_BLOCK else max(8, fits // 4 * 4)


def _stream_sum(
    n: int,
    block: int,
    blocks_of: Callable[[int, int], tuple[Tensor, ...]],
    device: torch.device,
    one_stream: bool = False,
) -> tuple[Tensor, ...]:
    """Σ of ``blocks_of(lo, hi)`` (a tuple of partial sums) over up to :data:`KRON_STREAMS`
    contiguous shares of n units, each single-threaded on the pool, added in a fixed order.

    The split depends on n only (never on the thread count), so in float64 (the default) the sum
    is the same bits in every process: a resumed run, a Ray worker and the local runtime agree
    exactly (tests/test_linalg.py). In float32 they agree to rounding: shares run concurrently
    were seen to differ in the last bit between two calls on the same input. Off the CPU the
    whole range is one call (the device is parallel by itself).
    """
    if one_stream or torch.device(device).type != "cpu":
        return blocks_of(0, n)
    threads, budget = torch.get_num_threads(), thread_budget()
    parts = max(1, min(KRON_STREAMS, n // (2 * block)))
    bounds = [round(n * i / parts / block) * block for i in range(parts)] + [n]
    torch.set_num_threads(1)
    try:
        if parts == 1:
            return blocks_of(0, n)
        shares = list(
            _pool(max(1, min(parts, budget))).map(lambda i: blocks_of(bounds[i], bounds[i + 1]), range(parts))
        )
    finally:
        torch.set_num_threads(threads)
    total = list(shares[0])
    for share in shares[1:]:
        for i, t in enumerate(share):
            total[i] += t
    return tuple(total)


@overload
def small_batched(fn: Callable[..., Tensor], *batched: Tensor, min_share: int = 64) -> Tensor: ...
@overload
def small_batched(
    fn: Callable[..., tuple[Tensor, ...]], *batched: Tensor, min_share: int = 64
) -> tuple[Tensor, ...]: ...
def small_batched(
    fn: Callable[..., Tensor | tuple[Tensor, ...]], *batched: Tensor, min_share: int = 64
) -> Tensor | tuple[Tensor, ...]:
    """``fn(*batched)`` for a batched LAPACK call on many small matrices (eigh, Cholesky, solve),
    run as up to :data:`KRON_STREAMS` contiguous shares of the leading dim, each on one pool
    thread with torch single-threaded, results concatenated along dim 0.

    MKL's threaded path for a batch of tiny matrices collapses on busy cores (measured on the
    2-core machine under load: ``eigh`` of 2,700 32×32 blocks 101 s threaded against 1.4 s on
    one thread), and every matrix is independent, so this is the same bits as one
    single-threaded call whatever the thread count. Off the CPU, one call.
    """
    n = int(batched[0].shape[0])
    if batched[0].device.type != "cpu":
        return fn(*batched)
    threads = torch.get_num_threads()
    parts = max(1, min(KRON_STREAMS, thread_budget(), n // min_share))
    bounds = [n * i // parts for i in range(parts + 1)]
    torch.set_num_threads(1)
    try:
        if parts == 1:
            return fn(*batched)
        shares = list(_pool(parts).map(lambda i: fn(*(t[bounds[i] : bounds[i + 1]] for t in batched)), range(parts)))
    finally:
        torch.set_num_threads(threads)
    tuples = [share for share in shares if isinstance(share, tuple)]  # fn returns one kind: all shares or none
    if tuples:
        return tuple(torch.cat(p) for p in zip(*tuples))
    return torch.cat([share for share in shares if isinstance(share, Tensor)])


KRON_STREAMS = 4
"""Contiguous shares of the users in :func:`kron_statistics` (run on up to that many threads)."""
DEVICE_BLOCK = 2048
"""Users per batched kernel on the device path (:func:`kron_statistics`, :func:`pair_statistic`):
their d×d Gram matrices, 80 MB in float32 at d = 100, are one kernel's output."""

from fedpers.pools import pool as _pool  # noqa: E402  (one pool per size, shared with data generation)

_BUDGET = threading.local()


def thread_budget() -> int:
    """The threads this thread's work may use: torch's thread count, or inside :func:`serial_small_ops`
    the count it set aside (for the single-threaded shares of :func:`_stream_sum` and
    :func:`small_batched`)."""
    return int(getattr(_BUDGET, "threads", 0)) or torch.get_num_threads()


@contextlib.contextmanager
def serial_small_ops(device: torch.device | str) -> Iterator[None]:
    """Run a client computation's many small ops (norms, clip factors, a few thousand users' k×k
    solves, the reassembly of a sum) on this thread alone, while its heavy parts still run as
    :func:`thread_budget` single-threaded shares on the pool.

    A small op split over torch's threads waits for every one of them: on a busy machine a thread
    that is not scheduled stalls the op for a time slice (measured at load 8 on the 2-core machine:
    a ``log`` of 4,096 values 24 ms, the round statistics' small ops together as long as their
    GEMMs). The shares' sums are the same bits (their split depends on n alone); a reduction
    over many entries outside them may add its partial sums in another order (float rounding).
    Off the CPU, nothing changes. Nested uses keep the outermost budget."""
    if torch.device(device).type != "cpu":
        yield
        return
    threads, outer = torch.get_num_threads(), getattr(_BUDGET, "threads", 0)
    _BUDGET.threads = outer or threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _BUDGET.threads = outer


def vec_to_matrix(u: Tensor, d: int, k: int) -> Tensor:
    """Inverse of column-stacking vec: (dk,) -> (d, k)."""
    return u.reshape(k, d).transpose(0, 1)


def orthonormal_basis(u: Tensor) -> Tensor:
    """Q of the thin QR of u (d, k), with signs fixed so diag(R) ≥ 0 (deterministic)."""
    q, r = torch.linalg.qr(u)
    signs = torch.sign(torch.diagonal(r))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs


ONE_THREAD_SIDE = 1024
"""Dense CPU decompositions up to this side run single-threaded (:func:`one_thread`)."""


@contextlib.contextmanager
def one_thread(t: Tensor) -> Iterator[None]:
    """Run a dense LAPACK call on a CPU matrix of side ≤ :data:`ONE_THREAD_SIDE` on one thread.

    Threaded LAPACK on a few-hundred-sided matrix gains little and collapses on busy cores
    (measured on the 2-core machine at load 9: ``eigh`` of AltMin's 500×500 A 0.67 s on two
    threads, 0.09 s on one; a whole 40k-user run spent 14 s in three such calls), and one thread
    gives the same bits whatever the machine's thread count."""
    if t.device.type != "cpu" or t.shape[-1] > ONE_THREAD_SIDE:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def top_eigenvectors(m: Tensor, k: int) -> Tensor:
    """Eigenvectors of the k largest eigenvalues of a symmetric matrix, as a (d, k) orthonormal basis."""
    with one_thread(m):
        _, vecs = torch.linalg.eigh(sym(m))
    return vecs[:, -k:].flip(-1)


def psd_eigen_floor(a: Tensor, floor: float) -> tuple[Tensor, int]:
    """Raise every eigenvalue of symmetric ``a`` to at least ``floor``; returns (matrix, how many raised)."""
    with one_thread(a):
        vals, vecs = torch.linalg.eigh(sym(a))
    raised = int((vals < floor).sum())
    vals = vals.clamp_min(floor)
    return (vecs * vals) @ vecs.transpose(0, 1), raised
