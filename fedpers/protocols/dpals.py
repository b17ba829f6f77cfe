"""DPALS: user-level private alternating least squares for matrix completion
(Jain–Thakkar–Thakurta 2018; Chien et al., "Private Alternating Least Squares", ICML 2021).

Units are users. Each user j holds ragged ratings, padded to width L: ``items`` (L,),
``ratings`` (L,), ``mask`` (L,) (True for a real training rating). Round t: the server
broadcasts the item embeddings U (items × k); user j solves v_j = (U_Iᵀ U_I + λI)⁻¹ U_Iᵀ r_I
on its own ratings, takes the first B of its rated items (the loader orders each user's
items by a permutation derived from the public seed and the user id), and sends per item i
the statistics G_i = v_j v_jᵀ and b_i = r_ij v_j, scatter-added into (items, k, k) and
(items, k) — never a dense (items·k)² matrix. G travels (message, sums, release) as its blocks'
upper triangles (items, k(k+1)/2), half the bytes of the full blocks.

User offsets (``user_bias`` κ_u > 0): each user first subtracts its own mean training rating shrunk
by κ_u pseudo-ratings, b_j = Σ r/(n_j + κ_u), and works on the residuals r − b_j; b_j never
leaves the user (its prediction adds it back), so what is sent, its bounds and the releases are
those below.

Per-user clipping (scale-safe): the user's whole G collection has Frobenius norm
√n_j·||v||², clipped to Γ_G; its b collection has norm ||r||·||v||, clipped to Γ_b. Both are
formed from unit directions v̂ = v/||v||, r̂ = r/||r|| and magnitudes min(·, Γ) computed in
log space (:func:`fedpers.linalg.clipped_magnitude`), so no finite rating or embedding can
overflow. Even v is solved on r̂ (v is linear in r) and rescaled through its log-norm.

Optional round 0 (``prelude``): each user sends, over the same first B of its rated items, its
ratings (the vector clipped to √B·c_r) and its indicators, scatter-added into per-item sums s
and counts c, each with a total entry (see :func:`item_counts`; bounds √2·√B·c_r and √(2B)),
each one Gaussian release. Post-processing gives the private global mean μ̂ = s_total/c_total
(subtracted from every rating in the ALS rounds), private item means (s_i + κμ̂)/(c_i⁺ + κ)
(a baseline), and the head items: the H largest noisy counts;
the others keep U_i = 0 (predicted by μ̂) and receive no statistics.

Server: one Gaussian release per statistic through the Privatizer. G is released as the
upper triangles of its blocks (items, k(k+1)/2), whose norm is ≤ ||G||_F; the replace-one
sensitivity used is the general 2·Γ (the √2·Γ PSD bound is not claimed here). Each noisy
block is repaired to PSD (eigenvalues floored at 0), and U_i = (G_i + λI)⁻¹ b_i.

Device path (``device_kernels``, docs/benchmarks.md): the statistics, the summed messages and
the solves stay on the units' device as a few batched kernels; the noise is still drawn by the
Privatizer on the server's CPU generator (float64) and copied over, so a CPU and a GPU run of one
seed add the same noise.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy
import scipy.sparse
import torch

from fedpers import linalg
from fedpers.devices import pending
from fedpers.pools import pool
from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message, NodeSide, Protocol, StatSpec, Units, UnitStatistics

Tensor = torch.Tensor


def user_embeddings(
    U: Tensor, items: Tensor, ratings: Tensor, mask: Tensor, ridge: float, device_kernels: bool = False
) -> tuple[Tensor, Tensor]:
    """(v̂, log||v||) with v_j = (U_Iᵀ U_I + λI)⁻¹ U_Iᵀ r_I over each user's masked ratings
    (:func:`user_solves`, then each solution's direction and log-norm)."""
    w, log_rn = user_solves(U, items, ratings, mask, ridge, device_kernels)
    v_unit, log_wn = linalg.directions(w)
    return v_unit, log_wn + log_rn


def user_solves(
    U: Tensor,
    items: Tensor,
    ratings: Tensor,
    mask: Tensor,
    ridge: float,
    device_kernels: bool = False,
    as_alone: bool = False,
) -> tuple[Tensor, Tensor]:
    """(w, log||r||): w_j = (U_Iᵀ U_I + λI)⁻¹ U_Iᵀ r̂_I, each user's solve on its unit rating direction
    r̂ = r/||r|| over its masked ratings (v = ||r||·w: v is linear in r), so a huge rating cannot overflow;
    users with no ratings or all-zero ratings get w = 0 (log-norm −inf).

    U_I is one gather from U with a zero row appended (padding reads it), the k×k systems one batched
    Cholesky (λ > 0 makes them positive definite; a failed factorisation falls back to LU for that user
    only). On the host path (``device_kernels`` False) the users go as :func:`fedpers.linalg.small_batched`
    single-threaded shares, each gathering, multiplying and solving its users in blocks of at most
    :data:`GATHER_BUDGET` gathered entries per share; on the device path each is one batched kernel. Every
    user's Gram matrix, right-hand side and solve are its own batch entry, so the result is the same bits
    whatever the blocks and shares. ``as_alone`` (host path): each user's bits as it gets them alone
    (:func:`_solves_as_alone`)."""
    n_items, k = U.shape
    r_unit, log_rn = linalg.directions(ratings.to(U.dtype) * mask.to(U.dtype))
    padded = torch.cat([U, U.new_zeros(1, k)])
    index = items.masked_fill(~mask, n_items)
    n, width = index.shape
    if as_alone:
        return _solves_as_alone(padded, index, r_unit, ridge), log_rn
    shares = 1 if device_kernels else max(1, linalg.thread_budget())
    step = max(1, n) if device_kernels else max(1, GATHER_BUDGET // max(1, width * k * shares))

    def solved(index: Tensor, r_unit: Tensor) -> Tensor:
        m = int(index.shape[0])
        A = torch.empty(m, k, k, dtype=U.dtype, device=U.device)
        rhs = torch.empty(m, k, dtype=U.dtype, device=U.device)
        for lo in range(0, m, step):
            block = index[lo : lo + step]
            F = torch.index_select(padded, 0, block.reshape(-1)).view(*block.shape, k)  # (users, L, k)
            torch.bmm(F.transpose(1, 2), F, out=A[lo : lo + step])
            rhs[lo : lo + step] = torch.bmm(r_unit[lo : lo + step].unsqueeze(1), F).squeeze(1)  # r̂ᵀF: 2× Fᵀr̂'s speed
        A.diagonal(dim1=-2, dim2=-1).add_(ridge)
        return spd_solve(A, rhs)

    w = solved(index, r_unit) if device_kernels else linalg.small_batched(solved, index, r_unit)
    return w, log_rn


GATHER_BUDGET = 1 << 20
"""Gathered entries U_I (users × L × k) held at once on the host path, shared by the thread shares
(4 MiB in float32, an eighth of the earlier 32 MiB blocks): a block that stays in cache while its
Gram products read it (six chunks at MovieLens-20M's shape, one thread, the command's malloc
policy: 0.46–0.49 CPU s against 0.52 in 32 MiB blocks)."""


def _solves_as_alone(padded: Tensor, index: Tensor, r_unit: Tensor, ridge: float) -> Tensor:
    """:func:`user_solves`' w for a batch, each user's the bits it gets alone.

    MKL's products and factorisations round by the alignment of their operands: a user alone has its
    gathered U_I, rating direction, Gram matrix and right-hand side each at the start of a fresh (64-byte
    aligned) allocation, while in a batch they sit at offsets of L·k, L and k·k entries. Here every user's
    operands start on a 64-byte boundary (:func:`_aligned`), in blocks of at most :data:`GATHER_BUDGET`
    gathered entries; the k×k solves run batched where the factorisation's rounding does not depend on
    the offset (:func:`_offset_free_solves`), else one user at a time as alone."""
    k = padded.shape[1]
    n, width = index.shape
    dtype, device = padded.dtype, padded.device
    r_al = _aligned(n, (1, width), dtype, device)
    r_al.copy_(r_unit.unsqueeze(1))
    A = _aligned(n, (k, k), dtype, device)
    rhs = _aligned(n, (1, k), dtype, device)
    step = max(1, GATHER_BUDGET // max(1, width * k))
    F = None if _naturally_aligned((width, k), dtype) else _aligned(min(n, step), (width, k), dtype, device)
    for lo in range(0, n, step):
        block = index[lo : lo + step]
        f = torch.index_select(padded, 0, block.reshape(-1)).view(*block.shape, k)
        if F is not None:
            f = F[: block.shape[0]].copy_(f)
        torch.bmm(f.transpose(1, 2), f, out=A[lo : lo + step])
        torch.bmm(r_al[lo : lo + step], f, out=rhs[lo : lo + step])
    A.diagonal(dim1=-2, dim2=-1).add_(ridge)
    if _offset_free_solves(k, dtype):
        return spd_solve(A, rhs.squeeze(1))
    w = torch.empty(n, k, dtype=dtype, device=device)
    for j in range(n):
        w[j] = spd_solve(A[j : j + 1].clone(), rhs[j, :1].clone())[0]
    return w


def _aligned(n: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised (n, *shape) tensor whose every entry [j] is contiguous and starts on a 64-byte
    boundary, as a fresh allocation of one would (torch's CPU allocator aligns to 64 bytes)."""
    if _naturally_aligned(shape, dtype):  # every entry of a contiguous batch starts on one already
        return torch.empty(n, *shape, dtype=dtype, device=device)
    size = dtype.itemsize
    per = math.prod(shape)
    stride = -(-per * size // 64) * 64 // size
    base = torch.empty(n * stride + 64 // size, dtype=dtype, device=device)
    offset = (-base.data_ptr() % 64) // size
    inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return base.as_strided((n, *shape), (stride, *inner), offset)


def _naturally_aligned(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return (math.prod(shape) * dtype.itemsize) % 64 == 0


def _offset_free_solves(k: int, dtype: torch.dtype) -> bool:
    """Whether a batched Cholesky solve of k×k systems gives each system the bits it gets alone: when every
    matrix of the batch starts on a 64-byte boundary (k²·entry size a multiple of 64), or k ≤ 8, where
    MKL's small-matrix factorisation rounds the same at every offset (measured for k = 1…40, float64
    and float32: a batch at offsets of k² entries differs from the systems alone only at odd k ≥ 9
    and, in float32, at k = 34, 38; tests/test_node_batched.py holds the batched path to the one-unit
    path on the machine it runs on)."""
    return k <= 8 or _naturally_aligned((k, k), dtype)


def spd_solve(A: Tensor, rhs: Tensor) -> Tensor:
    """A⁻¹ rhs for a batch of symmetric positive definite A (..., k, k), rhs (..., k): Cholesky,
    with LU for the problems whose factorisation fails (so no answer depends on its batch-mates)."""
    chol, info = torch.linalg.cholesky_ex(A)
    out = torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
    checks = pending()
    if checks is not None:  # no failure, or the round is made again with this read
        checks.expect((info == 0).all())
        return out
    failed = (info != 0).nonzero(as_tuple=True)[0]
    if failed.numel():
        out[failed] = torch.linalg.solve(A[failed], rhs[failed].unsqueeze(-1)).squeeze(-1)
    return out


def user_offsets(ratings: Tensor, mask: Tensor, prior: float) -> Tensor:
    """b_j = Σ_I r / (n_j + κ_u): each user's own mean training rating, shrunk towards 0 by κ_u
    pseudo-ratings (0 for a user without ratings). Computed and used only by its user: never sent.

    The mean is summed as Σ r/n_j, so no finite rating overflows it."""
    m = mask.to(ratings.dtype)
    n = m.sum(-1)
    mean = (ratings * m / n.clamp_min(1).unsqueeze(-1)).sum(-1)
    return mean * (n / (n + prior))


def residuals(ratings: Tensor, offsets: Tensor) -> Tensor:
    """r − b_j for every entry, kept finite (a residual beyond the dtype's range is clamped to it:
    the per-user clips bound what it contributes either way)."""
    big = torch.finfo(ratings.dtype).max
    return (ratings - offsets.unsqueeze(-1)).clamp(-big, big)


def selected(mask: Tensor, items_per_user: int) -> Tensor:
    """The first B of each user's rated items (the loader's public per-user order)."""
    return mask & (torch.cumsum(mask.to(torch.int32), dim=1, dtype=torch.int32) <= items_per_user)


def item_counts(
    items: Tensor, ratings: Tensor, mask: Tensor, items_per_user: int, n_items: int, rating_bound: float
) -> tuple[Tensor, Tensor]:
    """Per-item sums (s, c), each with one more entry for the totals, of the users' selected
    ratings (each user's vector clipped to ``rating_bound``, scale-safe) and indicators.

    Entry ``n_items`` of a user's s is Σ_i r_i/√B (|·| ≤ its vector's norm, Cauchy–Schwarz) and of
    its c is count/√B (≤ √count): the user's s has norm ≤ √2·bound, its c ≤ √(2B). The totals give
    the global mean with noise √B·σ instead of √items·σ from summing the per-item entries."""
    sel, r = clipped_selection(ratings, mask, items_per_user, rating_bound)
    root_b = math.sqrt(items_per_user)
    s = torch.zeros(n_items + 1, dtype=ratings.dtype, device=ratings.device)
    c = torch.zeros(n_items + 1, dtype=ratings.dtype, device=ratings.device)
    if ratings.device.type == "cpu":
        flat = items[sel]
        s.index_add_(0, flat, r[sel])
        c.index_add_(0, flat, torch.ones_like(r[sel]))
    else:  # no selection by a mask (a host read): every entry added, the unselected ones into the totals' slot
        flat = items.masked_fill(~sel, n_items).reshape(-1)
        s.index_add_(0, flat, r.masked_fill(~sel, 0).reshape(-1))
        c.index_add_(0, flat, sel.to(ratings.dtype).reshape(-1))
    s[n_items] = (r.sum(1) / root_b).sum()  # (overwrites what the unselected entries added there)
    c[n_items] = (sel.sum(1).to(ratings.dtype) / root_b).sum()
    return s, c


def clipped_selection(ratings: Tensor, mask: Tensor, items_per_user: int, rating_bound: float) -> tuple[Tensor, Tensor]:
    """(the first B of each user's rated items, its ratings there as a vector clipped to ``rating_bound``,
    scale-safe: zero elsewhere): what one user adds to round 0's sums."""
    sel = selected(mask, items_per_user)
    r_unit, log_rn = linalg.directions(ratings * sel.to(ratings.dtype))
    return sel, r_unit * linalg.clipped_magnitude(log_rn, rating_bound).to(ratings.dtype).unsqueeze(-1)


def unit_item_counts(
    items: Tensor, ratings: Tensor, mask: Tensor, items_per_user: int, n_items: int, rating_bound: float
) -> tuple[Tensor, Tensor]:
    """:func:`item_counts` of each user alone, (n, items + 1) each: row j's selected ratings and indicators
    added into zeros at its items (in its own order, as the one-user sum adds them), its totals entry set."""
    sel, r = clipped_selection(ratings, mask, items_per_user, rating_bound)
    n = sel.shape[0]
    root_b = math.sqrt(items_per_user)
    where, _, dest = _selected_rows(items, sel, n_items + 1)
    s = torch.zeros(n, n_items + 1, dtype=ratings.dtype, device=ratings.device)
    c = torch.zeros(n, n_items + 1, dtype=ratings.dtype, device=ratings.device)
    s.view(-1).index_add_(0, dest, r.reshape(-1).index_select(0, where))
    c.view(-1).index_add_(0, dest, torch.ones(dest.shape, dtype=ratings.dtype, device=ratings.device))
    s[:, n_items] = r.sum(1) / root_b
    c[:, n_items] = sel.sum(1).to(ratings.dtype) / root_b
    return s, c


def unit_item_rows(
    items: Tensor,
    sel: Tensor,
    n_items: int,
    factors: tuple[Tensor, Tensor, Tensor, Tensor],
    v_unit: Tensor,
) -> tuple[Tensor, Tensor]:
    """:func:`item_statistics` (packed) of each user alone, (n, items, k(k+1)/2) and (n, items, k): the user's
    products (:func:`user_factors`) written at its selected items, zeros elsewhere, each the one product the
    CSR sum forms for it — so the same values as the user's own sum when no item is selected twice (a zero
    may differ in sign, which neither the encoding nor the local noise can see)."""
    outer, g_mag, r_unit, b_mag = factors
    n = sel.shape[0]
    where, users, dest = _selected_rows(items, sel, n_items)
    G = torch.zeros(n * n_items, outer.shape[1], dtype=outer.dtype, device=outer.device)
    b = torch.zeros(n * n_items, v_unit.shape[1], dtype=v_unit.dtype, device=v_unit.device)
    # each destination row once (a user's items are distinct here): copied, not added (6× faster)
    G.index_copy_(0, dest, g_mag.index_select(0, users).unsqueeze(1) * outer.index_select(0, users))
    b_vals = r_unit.reshape(-1).index_select(0, where) * b_mag.index_select(0, users)
    b.index_copy_(0, dest, b_vals.unsqueeze(1) * v_unit.index_select(0, users))
    return G.view(n, n_items, outer.shape[1]), b.view(n, n_items, v_unit.shape[1])  # n may be 0


def _selected_rows(items: Tensor, sel: Tensor, rows_per_user: int) -> tuple[Tensor, Tensor, Tensor]:
    """(flat positions of the selected entries, their users, their rows in an (n·rows_per_user, ·) array of
    per-user item rows): where each selected (user, item) pair is written."""
    where = sel.reshape(-1).nonzero().squeeze(1)
    users = torch.div(where, sel.shape[1], rounding_mode="floor")
    return where, users, users * rows_per_user + items.reshape(-1).index_select(0, where)


def repeated_items(items: Tensor, sel: Tensor) -> Tensor:
    """(n,) bool: users with an item selected twice (the loaders drop such repeats; a unit may still carry one)."""
    if sel.shape[1] < 2:
        return torch.zeros(sel.shape[0], dtype=torch.bool, device=sel.device)
    marked = items.masked_fill(~sel, -1).sort(1).values
    return ((marked[:, 1:] == marked[:, :-1]) & (marked[:, 1:] >= 0)).any(1)


def item_statistics(
    U: Tensor,
    items: Tensor,
    ratings: Tensor,
    mask: Tensor,
    ridge: float,
    items_per_user: int,
    gram_bound: float,
    rhs_bound: float,
    device_kernels: bool = False,
    packed: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per-item sums (G (items, k, k), b (items, k)) of the users' clipped contributions; with
    ``packed``, G as its blocks' upper triangles (items, k(k+1)/2) (:func:`triu_pack`'s order).

    The sums are two sparse (items × users) CSR products with the users' k(k+1)/2 products
    v̂_a v̂_b (a ≤ b; G is exactly symmetric) and with v̂: nnz·k(k+1)/2 work, no (nnz, k, k)
    temporary. The CSR is the user-major selection transposed: on the host a counting sort
    (scipy's CSR → CSC, O(nnz)), the products in single-threaded shares of the items; on the
    device path a sort of the (item, user) keys and one product each. Both order every item's
    users ascending, so both paths sum in the same order."""
    n_items, k = U.shape
    v_unit, log_vn = user_embeddings(U, items, ratings, mask, ridge, device_kernels)
    sel = selected(mask, items_per_user)
    per_user = sel.sum(1)
    outer, g_mag, r_unit, b_mag = user_factors(v_unit, log_vn, ratings, sel, gram_bound, rhs_bound)
    width = sel.shape[1]
    if items.device.type != "cpu":
        # every entry kept (how many are selected is not read): the unselected ones go to an extra item
        # n_items, dropped after the products; each real item's row holds what the selection would give it
        where = torch.arange(sel.numel(), device=items.device)
        flat_items = items.masked_fill(~sel, n_items).reshape(-1)
        rows = n_items + 1
    else:
        where = sel.reshape(-1).nonzero().squeeze(1)  # the selected ratings, user-major
        flat_items = items.reshape(-1).index_select(0, where)
        rows = n_items
    users = torch.div(where, width, rounding_mode="floor")
    crow, order = _item_major(flat_items, users, per_user, rows, device_kernels)
    users = users.index_select(0, order)
    g_vals = g_mag.index_select(0, users)
    b_vals = r_unit.reshape(-1).index_select(0, where.index_select(0, order)) * b_mag.index_select(0, users)
    G = [t[:n_items] for t in _csr_products(crow, users, (g_vals, b_vals), (outer, v_unit), device_kernels)]
    return (G[0] if packed else triu_unpack(G[0], k)), G[1]


def user_factors(
    v_unit: Tensor, log_vn: Tensor, ratings: Tensor, sel: Tensor, gram_bound: float, rhs_bound: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each user's clipped contribution in factors, (v̂ v̂ᵀ's upper triangle (n, k(k+1)/2), g, r̂ (n, L), β):
    its G_i = g·v̂ v̂ᵀ on each selected item i, its b_i = (r̂_i·β)·v̂. g = min(√n_j·||v||², Γ_G)/√n_j (0 for a
    user with no selected item) and β = min(||r||·||v||, Γ_b) are formed from log-norms, so no finite
    rating or embedding overflows them; r̂ is the direction of the selected ratings."""
    count = sel.sum(1).double()
    g_mag = (
        linalg.clipped_magnitude(2 * log_vn + 0.5 * count.clamp_min(1).log(), gram_bound) / count.clamp_min(1).sqrt()
    )
    r_unit, log_rn = linalg.directions(ratings.to(v_unit.dtype) * sel.to(v_unit.dtype))
    b_mag = linalg.clipped_magnitude(log_rn + log_vn, rhs_bound).to(v_unit.dtype)
    g_mag = torch.where(count > 0, g_mag, torch.zeros_like(g_mag)).to(v_unit.dtype)
    # gathers by index_select (several times faster on the CPU than advanced indexing)
    k = v_unit.shape[1]
    rows, cols = torch.triu_indices(k, k, device=v_unit.device)
    outer = v_unit.index_select(1, rows) * v_unit.index_select(1, cols)  # (n, k(k+1)/2): triu of v̂ v̂ᵀ
    return outer, g_mag, r_unit, b_mag


def _item_major(
    flat_items: Tensor, users: Tensor, per_user: Tensor, n_items: int, device_kernels: bool
) -> tuple[Tensor, Tensor]:
    """(row pointers of the items, permutation of the user-major pairs into item-major order,
    users ascending within each item)."""
    if device_kernels or flat_items.device.type != "cpu":
        # stable: a user rating an item twice keeps its ratings' order, as the counting sort does
        keys, order = torch.sort(flat_items * per_user.shape[0] + users, stable=True)
        # row i starts at the first key of item i: the counts' cumulative sum, without bincount's read of the maximum
        starts = torch.arange(n_items + 1, dtype=torch.int64, device=flat_items.device) * per_user.shape[0]
        return torch.searchsorted(keys, starts), order
    nnz = int(flat_items.shape[0])
    n = int(per_user.shape[0])
    user_ptr = torch.zeros(n + 1, dtype=torch.int64)
    user_ptr[1:] = torch.cumsum(per_user, 0)
    pairs = scipy.sparse.csr_matrix(
        (numpy.arange(nnz, dtype=numpy.int64), flat_items.numpy(), user_ptr.numpy()), shape=(n, n_items)
    ).tocsc()  # counting sort by item, stable in the users
    return torch.from_numpy(pairs.indptr.astype(numpy.int64)), torch.from_numpy(pairs.data)


def _csr_products(
    crow: Tensor, col: Tensor, values: tuple[Tensor, ...], dense: tuple[Tensor, ...], device_kernels: bool
) -> list[Tensor]:
    """[CSR(crow, col, values[i]) @ dense[i]]; on the host in up to ``KRON_STREAMS`` row shares of
    about equal nonzeros, each single-threaded on the pool (torch's CSR product does not gain from
    threads on the CPU); each row's sum is the same either way."""
    n_rows, n_cols = int(crow.shape[0]) - 1, int(dense[0].shape[0])
    if device_kernels or crow.device.type != "cpu":
        return [_csr(crow, col, v, (n_rows, n_cols)) @ d for v, d in zip(values, dense)]
    crow32, col32 = crow.to(torch.int32), col.to(torch.int32)
    nnz = int(crow[-1])
    threads = torch.get_num_threads()
    parts = max(1, min(linalg.KRON_STREAMS, linalg.thread_budget(), nnz // 4096))
    cuts = [0] + [int(torch.searchsorted(crow, nnz * i // parts)) for i in range(1, parts)] + [n_rows]

    outs = [torch.empty(n_rows, d.shape[1], dtype=d.dtype) for d in dense]

    def share(i: int) -> None:  # writes its rows of every product in place (no concatenation)
        lo, hi = cuts[i], cuts[i + 1]
        a, z = int(crow[lo]), int(crow[hi])
        ptr = crow32[lo : hi + 1] - crow32[lo]
        for v, d, out in zip(values, dense, outs):
            torch.mm(_csr(ptr, col32[a:z], v[a:z], (hi - lo, n_cols)), d, out=out[lo:hi])

    torch.set_num_threads(1)
    try:
        if parts == 1:
            share(0)
        else:
            list(pool(parts).map(share, range(parts)))
    finally:
        torch.set_num_threads(threads)
    return outs


def _csr(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the product used here is stable
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def triu_pack(G: Tensor) -> Tensor:
    k = G.shape[-1]
    i, j = torch.triu_indices(k, k, device=G.device)
    return G[..., i, j]


def triu_unpack(t: Tensor, k: int) -> Tensor:
    """The symmetric blocks (..., k, k) whose upper triangles :func:`triu_pack` gave: one gather."""
    return t.index_select(-1, _triu_positions(k, t.device)).view(*t.shape[:-1], k, k)


def _triu_positions(k: int, device: torch.device) -> Tensor:
    """Entry (a, b) of a k×k block → its position in the packed upper triangle (min(a, b), max(a, b))."""
    i, j = torch.triu_indices(k, k)
    pos = torch.empty(k, k, dtype=torch.int64)
    pos[i, j] = torch.arange(i.shape[0])
    pos[j, i] = torch.arange(i.shape[0])
    return pos.reshape(-1).to(device)


def psd_floor(G: Tensor) -> tuple[Tensor, int]:
    """(sym(G_i) with eigenvalues floored at 0, number of blocks repaired): blocks a batched
    Cholesky finds positive definite are returned as they are (the floor would not move them)."""
    G = linalg.sym(G)
    _, info = linalg.small_batched(lambda g: torch.linalg.cholesky_ex(g), G)
    bad = (info != 0).nonzero(as_tuple=True)[0]
    if bad.numel():
        vals, vecs = linalg.small_batched(lambda g: torch.linalg.eigh(g), G[bad])
        G = G.clone()
        G[bad] = (vecs * vals.clamp_min(0).unsqueeze(-2)) @ vecs.transpose(-1, -2)
    return G, int(bad.numel())


def solve_items(
    G: Tensor,
    b: Tensor,
    ridge: float,
    psd_repair: bool = True,
    device_kernels: bool = False,
    symmetric: bool = False,
    packed: bool = False,
) -> Tensor:
    """U_i = (PSD(G_i) + λI)⁻¹ b_i for every item (batched); G (items, k, k), or with ``packed`` its
    blocks' upper triangles (items, k(k+1)/2) (:func:`triu_pack`'s order; unpacked a share at a time).

    PSD(G_i) floors G_i's eigenvalues at 0. A batched Cholesky of G_i says which blocks are not
    positive definite (the floor would not move the others, solved by Cholesky of G_i + λI); only
    those go through the (costlier) eigendecomposition G_i = V Λ Vᵀ and are solved in its basis,
    U_i = V (Λ₊ + λ)⁻¹ Vᵀ b_i. On the host path each share of the items
    (:func:`fedpers.linalg.small_batched`) unpacks, tests, decomposes and solves its own blocks with
    every LAPACK call single-threaded: MKL's threaded path on thousands of k×k blocks is what made
    the repair 94 % of a step; on the device path each is one batched kernel. Every block is its own
    batch entry: the same bits whatever the shares where each block fills whole 64-byte lines (k = 32;
    otherwise LAPACK's eigh may round differently where a block's alignment moves).
    """
    k = b.shape[-1]
    eye = torch.eye(k, dtype=b.dtype, device=b.device)

    def solve(g: Tensor, r: Tensor) -> Tensor:
        # ``symmetric``: exactly so already (unpacked triangles)
        g = triu_unpack(g, k) if packed else g if symmetric else linalg.sym(g)
        if not psd_repair or not g.shape[0]:
            return spd_solve(g + ridge * eye, r)
        _, info = torch.linalg.cholesky_ex(g)
        bad = (info != 0).nonzero(as_tuple=True)[0]
        if not bad.numel():
            return spd_solve(g + ridge * eye, r)
        whole = bad.numel() == g.shape[0]  # under noise almost every block: no gathers
        g_bad, r_bad = (g, r) if whole else (g[bad], r[bad])
        vals, vecs = torch.linalg.eigh(g_bad)
        coef = (vecs.transpose(-1, -2) @ r_bad.unsqueeze(-1)).squeeze(-1) / (vals.clamp_min(0) + ridge)
        repaired = (vecs @ coef.unsqueeze(-1)).squeeze(-1)
        if whole:
            return repaired
        U = torch.empty_like(r)
        good = (info == 0).nonzero(as_tuple=True)[0]
        U[good] = spd_solve(g[good] + ridge * eye, r[good])
        U[bad] = repaired
        return U

    return solve(G, b) if device_kernels else linalg.small_batched(solve, G, b)


@dataclass(frozen=True)
class DpAlsProtocol(Protocol):
    """Public parameters of DPALS; ``initial_U`` is public (derived from the public seed)."""

    n_items: int
    rank: int
    steps: int
    items_per_user: int
    ridge_user: float
    ridge_item: float
    gram_bound: float
    rhs_bound: float
    noise_multiplier: float
    initial_U: Tensor
    dtype_name: str = "float64"
    prelude: bool = False
    """Round 0 releases per-item rating sums and counts (private centring, head items, item means)."""
    head_items: int = 0
    """H > 0: only the H items with the largest noisy counts are learnt (needs ``prelude``)."""
    rating_bound: float = math.inf
    """Clip of a user's selected ratings as a vector in round 0: √B·c_r."""
    user_bias: float = 0.0
    """κ_u > 0: each user first subtracts its own shrunk mean rating b_j (:func:`user_offsets`) and
    works on the residuals; local to the user, so the statistics, their bounds and the releases are
    unchanged. 0: no user offsets."""
    device_kernels: bool = False
    """Take the device code path (:func:`fedpers.config.device_path`): statistics and solves as a
    few large batched kernels on the units' device, no host thread shares or scipy."""

    name = "dpals"
    ITEM_MEAN_PRIOR = 5.0
    """κ₀: pseudo-ratings at μ̂ in the private item means (see :meth:`item_means`)."""

    @property
    def num_rounds(self) -> int:
        return self.steps + int(self.prelude)

    @property
    def sum_bound(self) -> float:
        """Γ_s = √2·√B·c_r: the user's clipped rating vector plus its total entry."""
        return math.sqrt(2.0) * self.rating_bound

    @property
    def count_bound(self) -> float:
        """Γ_c = √(2B): indicators plus the count entry."""
        return math.sqrt(2.0 * self.items_per_user)

    def is_prelude(self, round: int) -> bool:
        return self.prelude and round == 0

    def initial_state(self) -> dict[str, Tensor]:
        return {"U": self.initial_U.to(self.dtype)}

    def broadcast(self, state: Mapping[str, Any], round: int) -> dict[str, Tensor]:
        if self.is_prelude(round):
            return {}
        if self.prelude:
            return {"U": state["U"], "mu": state["mu"], "head": state["head"]}
        return {"U": state["U"]}

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        k = self.rank
        if self.is_prelude(round):
            return (
                StatSpec("s", (self.n_items + 1,), self.sum_bound),
                StatSpec("c", (self.n_items + 1,), self.count_bound),
            )
        return (
            StatSpec("G", (self.n_items, k * (k + 1) // 2), self.gram_bound),
            StatSpec("b", (self.n_items, k), self.rhs_bound),
        )

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        with linalg.serial_small_ops(units["items"].device):  # many small ops; the heavy ones run in shares
            return self._client_update(round, broadcast, units)

    def _client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        ratings, mask = units["ratings"].to(self.dtype), units["mask"]
        if self.is_prelude(round):
            s, c = item_counts(units["items"], ratings, mask, self.items_per_user, self.n_items, self.rating_bound)
            return Message({"s": s, "c": c}, int(units["ids"].shape[0]))
        ratings, mask = self.round_inputs(broadcast, units)
        U = broadcast["U"].to(units["items"].device, self.dtype)
        G, b = item_statistics(
            U,
            units["items"],
            ratings,
            mask,
            self.ridge_user,
            self.items_per_user,
            self.gram_bound,
            self.rhs_bound,
            self.device_kernels,
            packed=True,
        )
        return Message({"G": G, "b": b}, int(units["ids"].shape[0]))

    def round_inputs(self, broadcast: Mapping[str, Tensor], units: Units) -> tuple[Tensor, Tensor]:
        """(ratings, mask) an ALS round's users work on: centred by μ̂, less each user's own offset, the mask
        restricted to the head items (as configured)."""
        ratings, mask = units["ratings"].to(self.dtype), units["mask"]
        if self.prelude:  # μ̂: a public scalar (a 0-dim host tensor enters a device kernel as a number)
            mu = broadcast["mu"]
            mu = mu.to(self.dtype) if mu.dim() == 0 else mu.to(ratings.device, self.dtype)
            ratings = (ratings - mu) * (mask | units["test"]).to(self.dtype)
        if self.user_bias > 0:  # over all of the user's training ratings, before the head restriction
            ratings = residuals(ratings, user_offsets(ratings, mask, self.user_bias))
        if self.prelude:
            mask = mask & (broadcast["head"].to(mask.device)[units["items"]] > 0)
        return ratings, mask

    def unit_statistics(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> UnitStatistics | None:
        """Each user's own (s, c) (round 0) or (G, b), batched: the ops :meth:`client_update` runs on one user,
        on every user of the batch at once, each user's products scattered into its own (items, ·) rows
        (:func:`unit_item_counts`, :func:`unit_item_rows`). Left to be computed alone: a user whose norms
        that path would not trust as computed (:func:`~fedpers.linalg.trusted_rows`), and in an ALS round a
        user with an item selected twice (its CSR sum adds the two products in the product's own way). Host
        path only (the device path's one-user statistics are its sorted kernels)."""
        if self.device_kernels:
            return None
        with linalg.serial_small_ops(units["items"].device):
            return self._unit_statistics(round, broadcast, units)

    def _unit_statistics(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> UnitStatistics:
        ids, items, B = units["ids"], units["items"], self.items_per_user
        everyone = torch.arange(int(ids.shape[0]), device=ids.device)
        if self.is_prelude(round):
            ratings, mask = units["ratings"].to(self.dtype), units["mask"]
            ok = linalg.trusted_rows(ratings * selected(mask, B).to(self.dtype))
            s, c = unit_item_counts(items[ok], ratings[ok], mask[ok], B, self.n_items, self.rating_bound)
            return UnitStatistics(ids[ok], {"s": s, "c": c}, everyone[~ok])
        ratings, mask = self.round_inputs(broadcast, units)
        sel = selected(mask, B)
        ok = linalg.trusted_rows(ratings * mask.to(self.dtype)) & linalg.trusted_rows(ratings * sel.to(self.dtype))
        ok &= ~repeated_items(items, sel)
        U = broadcast["U"].to(items.device, self.dtype)
        w, log_rn = user_solves(U, items[ok], ratings[ok], mask[ok], self.ridge_user, as_alone=True)
        fine = linalg.trusted_rows(w)  # its direction: the plain branch, as alone
        ok[ok.clone()] = fine
        v_unit, log_wn = linalg.directions(w[fine])
        factors = user_factors(v_unit, log_wn + log_rn[fine], ratings[ok], sel[ok], self.gram_bound, self.rhs_bound)
        G, b = unit_item_rows(items[ok], sel[ok], self.n_items, factors, v_unit)
        return UnitStatistics(ids[ok], {"G": G, "b": b}, everyone[~ok])

    def node_side(self) -> NodeSide | str:
        """Every release (the prelude's s and c, each round's G and b) is a Gaussian sum at z."""
        return NodeSide(self.noise_multiplier)

    def unit_keys(self) -> tuple[str, ...]:
        return ("items", "ratings", "mask", "test") if self.prelude else ("items", "ratings", "mask")

    def prelude_update(self, summed: Message, privatizer: Privatizer) -> dict[str, Tensor]:
        """Round 0: noisy per-item sums and counts → μ̂, head items, U restricted to the head."""
        z = self.noise_multiplier
        params = {
            "items_per_user": self.items_per_user,
            "statistic": "per-item rating sums (vector clipped to √B·c_r) and counts, each with a total entry /√B; bounds √2·√B·c_r and √(2B)",
        }
        s = privatizer.gaussian_sum(
            summed.stats["s"],
            per_unit_bound=self.sum_bound,
            noise_multiplier=z,
            name="dpals.item_sums",
            round=0,
            params=params,
        )
        c = privatizer.gaussian_sum(
            summed.stats["c"],
            per_unit_bound=self.count_bound,
            noise_multiplier=z,
            name="dpals.item_counts",
            round=0,
            params=params,
        )
        s, c = s.double(), c.double()
        mu = s[-1] / c[-1].clamp_min(1.0 / math.sqrt(self.items_per_user))
        s, c = s[:-1], c[:-1]
        head = torch.ones(self.n_items, dtype=torch.float64, device=c.device)
        if 0 < self.head_items < self.n_items:
            head = torch.zeros(self.n_items, dtype=torch.float64, device=c.device)
            head[torch.topk(c, self.head_items).indices] = 1.0
        U = self.initial_U.to(c.device, self.dtype) * head.to(self.dtype).unsqueeze(-1)
        return {"U": U, "mu": mu.to(self.dtype), "head": head, "item_sums": s, "item_counts": c}

    def item_means(self, state: Mapping[str, Tensor]) -> Tensor:
        """Private item means (s_i + κμ̂)/(c_i⁺ + κ) from round 0's releases. κ = κ₀ + 4σ_s/c_r
        (public) caps the noise's share of an item's mean at about c_r/4 whatever its count."""
        sigma_s = self.noise_multiplier * self.sum_bound
        kappa = self.ITEM_MEAN_PRIOR + (
            4 * sigma_s * math.sqrt(self.items_per_user) / self.rating_bound if sigma_s > 0 else 0.0
        )  # rating_bound = √B·c_r
        mu = state["mu"].double()
        return (state["item_sums"] + kappa * mu) / (state["item_counts"].clamp_min(0) + kappa)

    def server_update(
        self, round: int, state: Mapping[str, Any], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Any], dict[str, float]]:
        # the item solves run in shares; the rest is small or memory-bound: one thread (no stalls)
        with linalg.serial_small_ops(summed.stats[next(iter(summed.stats))].device):
            return self._server_update(round, state, summed, privatizer)

    def _server_update(
        self, round: int, state: Mapping[str, Any], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Any], dict[str, float]]:
        if self.is_prelude(round):
            return self.prelude_update(summed, privatizer), {}
        k = self.rank
        z = self.noise_multiplier
        params = {"items_per_user": self.items_per_user, "rank": k}
        g_bound, b_bound = self.gram_bound, self.rhs_bound
        if z > 0 and not (math.isfinite(self.gram_bound) and math.isfinite(self.rhs_bound)):
            raise ValueError("noise needs finite gram_bound and rhs_bound")
        g = privatizer.gaussian_sum(
            summed.stats["G"],
            per_unit_bound=g_bound,
            noise_multiplier=z,
            name="dpals.G",
            round=round,
            params=params,
        )
        b = privatizer.gaussian_sum(
            summed.stats["b"], per_unit_bound=b_bound, noise_multiplier=z, name="dpals.b", round=round, params=params
        )
        U = solve_items(g, b, self.ridge_item, psd_repair=z > 0, device_kernels=self.device_kernels, packed=True)
        if self.prelude:
            U = U * state["head"].to(U.device, U.dtype).unsqueeze(-1)
            return {**state, "U": U}, {"U_norm": float(torch.linalg.matrix_norm(U))}
        return {"U": U}, {"U_norm": float(torch.linalg.matrix_norm(U))}
