"""Synthetic data of docs/algorithms.md §1, generated in fixed blocks of users so any node can make its own slice.

User j's data depends only on (seed, j): a node holding users [a, b) generates exactly
the rows the local runtime would, which is what makes runtimes comparable seed for seed.

Two schemes, both keyed by (seed, block of :data:`BLOCK` users), so the users are the same
for any chunking, order or subset of ids asked for (docs/benchmarks.md, "Synthetic users"):

* float64 (the default, and every run before the float32 scheme existed): one CPU generator
  per block draws the block's x (all m samples), v* and label noise in float64, in that order.
  A float64 run keeps these users bit for bit; asking for half the samples saves the y
  product and the copies, not the draw (a Mersenne-Twister stream cannot skip ahead).
* float32 (and any device): one generator per (block, part), parts being v*, the first half
  of the samples (x and label noise) and the second half, drawing in float32 on the device
  the tensors live on. A round that uses only one half draws only that half. These are other
  draws from the same distribution than the float64 users of the seed (a float32 run and a
  float64 run of one seed share the truth U* and the cohorts, not the users); a CPU and a
  CUDA float32 run differ too (torch's CUDA generator is Philox, the CPU's Mersenne Twister).

Blocks are independent, so on the CPU they are drawn on a thread pool sized to torch's
threads, each block single-threaded: the same bits as drawing them one after another.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

import numpy as np
import torch

from fedpers.devices import to_device

Tensor = torch.Tensor
BLOCK = 1024
_STREAM_TRUTH, _STREAM_USERS, _STREAM_PARTS = 1, 2, 3
HALVES = (0, 1)
"""Sample halves: 0 is samples [0, m//2) (AltMin's Q1, Q2), 1 is [m//2, m) (Q3, Q4)."""

DRAWN: Counter[str] = Counter()
"""User-halves generated in this process, by dtype name ("float64", "float32"), for counting
passes over the users (:func:`passes`); :func:`reset_counts` clears it."""
_COUNT_LOCK = threading.Lock()


def reset_counts() -> None:
    DRAWN.clear()


def passes(n_users: int) -> float:
    """Passes over all ``n_users`` users' samples generated since :func:`reset_counts` (a half counts ½)."""
    return sum(DRAWN.values()) / (2 * max(n_users, 1))


def _seed(seed: int, *key: int) -> int:
    state = np.random.SeedSequence([int(seed), *map(int, key)]).generate_state(2, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def _generator(seed: int, *key: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_seed(seed, *key))


def subspace(seed: int, dim: int, rank: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """U* ∈ R^{d×k}, orthonormal, uniformly random."""
    g = _generator(seed, _STREAM_TRUTH)
    q, r = torch.linalg.qr(torch.randn(dim, rank, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


_BLOCKS: OrderedDict[tuple[int, ...], tuple[Tensor, Tensor, Tensor]] = OrderedDict()
_BLOCKS_LOCK = threading.Lock()
BLOCK_CACHE_BYTES = 256 << 20
"""Most bytes of generated user blocks one process keeps (only blocks asked for in part)."""


def _user_block(
    seed: int, blk: int, samples: int, d: int, k: int, partial: bool, halves: tuple[int, ...] = HALVES
) -> tuple[dict[int, Tensor], Tensor, Tensor]:
    """({half: x of that half (BLOCK, |half|, d)}, v*, noise) of the BLOCK users of block ``blk``
    (float64 scheme). A block asked for in part (a Flower node of a few users) is drawn whole and
    kept: the next node in this process from the same block — in a Ray simulation any actor
    serves any node — slices it instead of generating 1,024 users again.

    A block not kept and asked for one half draws only that half's normals (:func:`_draw_x`):
    the same bits, for about 60 % of the cost."""
    key = (int(seed), int(blk), samples, d, k)
    with _BLOCKS_LOCK:
        if key in _BLOCKS:
            _BLOCKS.move_to_end(key)
            bx, bv, bz = _BLOCKS[key]
            return {h: bx[:, slice(*half_range(samples, h))] for h in halves}, bv, bz
    g = _generator(seed, _STREAM_USERS, blk)
    keep = partial and BLOCK * samples * d * 8 <= BLOCK_CACHE_BYTES
    # a block not kept is drawn into this thread's reused buffers (the same values: a draw into
    # a contiguous tensor), so a pass does not fault in 33 MB of fresh pages per block
    xs = _draw_x(g, samples, d, HALVES if keep else halves, keep)
    bz = torch.empty(BLOCK, samples, dtype=torch.float64) if keep else _scratch("z", (BLOCK, samples))
    bv = torch.randn(BLOCK, k, generator=g, dtype=torch.float64)
    torch.randn(BLOCK, samples, generator=g, dtype=torch.float64, out=bz)
    with _COUNT_LOCK:
        DRAWN["float64"] += 2 * BLOCK
    if keep:
        with _BLOCKS_LOCK:
            _BLOCKS[key] = (xs["whole"], bv, bz)
            while sum(t.numel() * 8 for b in _BLOCKS.values() for t in b) > BLOCK_CACHE_BYTES:
                _BLOCKS.popitem(last=False)
    return {h: xs[h] for h in halves}, bv, bz


NORMAL_GROUP = 16
"""torch's CPU ``randn`` of a contiguous tensor of ≥ 16 values draws all its uniforms first (one
64-bit draw each), then turns each run of 16 into normals by Box–Muller (``normal_fill`` in
ATen's DistributionTemplates.h); ``rand`` draws the same uniforms, one 64-bit draw each."""


def _draw_x(g: torch.Generator, m: int, d: int, halves: tuple[int, ...], keep: bool) -> dict:
    """x of a block: exactly the normals one ``torch.randn(BLOCK, m, d)`` from ``g`` gives, for
    the asked-for halves ({half: (BLOCK, |half|, d)}, and "whole" when drawn whole), leaving ``g``
    where that call would. ``keep``: fresh memory (the block is cached), else this thread's buffers.

    One call draws every uniform and then transforms runs of :data:`NORMAL_GROUP`; as long as
    every user-half starts and ends on a run boundary, drawing user by user — ``randn`` for a
    half that is needed, ``rand`` (the same uniforms, no transform) for one that is not — gives
    the same values and the same generator state, and skips the Box–Muller transform (log,
    sincos: about 80 % of a float64 draw) of the halves nobody reads. Otherwise the whole block
    is drawn (tests/test_generation.py checks both against one call). No half at all (v* alone)
    draws only the uniforms."""
    spans = {h: half_range(m, h) for h in HALVES}
    aligned = all((b - a) * d % NORMAL_GROUP == 0 and (b - a) * d >= NORMAL_GROUP for a, b in spans.values())
    if not halves and not keep:  # v* alone (population draws): the uniforms only, a piece at a time
        total = BLOCK * m * d  # a multiple of 16: one randn of it has no recomputed tail
        skip = _scratch("x_skip", (min(total, 1 << 20),))
        for start in range(0, total, skip.numel()):
            torch.rand(min(skip.numel(), total - start), generator=g, dtype=torch.float64, out=skip[: total - start])
        return {}
    if len(halves) != 1 or not aligned:
        bx = torch.empty(BLOCK, m, d, dtype=torch.float64) if keep else _scratch("x", (BLOCK, m, d))
        torch.randn(BLOCK, m, d, generator=g, dtype=torch.float64, out=bx)
        return {"whole": bx, **{h: bx[:, a:b] for h, (a, b) in spans.items()}}
    (want,) = halves
    a, b = spans[want]
    out = _scratch("x_half", (BLOCK, b - a, d))
    skip = _scratch("x_skip", ((m - (b - a)) * d,))
    # normal_/uniform_ on a contiguous tensor are randn/rand's kernels (the same bits), with less call overhead
    for row in out.unbind(0):
        if want == 1:
            skip.uniform_(generator=g)
        row.normal_(generator=g)
        if want == 0:
            skip.uniform_(generator=g)
    return {want: out}


_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> Tensor:
    """This thread's CPU buffer ``name`` of ``shape`` and ``dtype`` (made once per shape): valid until
    the thread's next call, so only for blocks consumed before the thread draws another."""
    key = (name, shape, dtype)
    buf = getattr(_SCRATCH, "bufs", None)
    if buf is None:
        buf = _SCRATCH.bufs = {}
    if key not in buf:
        for old in [k for k in buf if k[0] == name]:
            del buf[old]
        buf[key] = torch.empty(shape, dtype=dtype)
    return buf[key]


def half_range(samples: int, half: int) -> tuple[int, int]:
    """Sample index range [a, b) of ``half`` (0 or 1) of ``samples``."""
    h = samples // 2
    return (0, h) if half == 0 else (h, samples)


def _parts_block(
    seed: int,
    blk: int,
    local: Tensor | None,
    u: Tensor,
    samples: int,
    noise_std: float,
    halves: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    into: dict[int, tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
    """float32/device scheme: v* and the asked-for halves' (x, y) of users ``local`` (on ``device``;
    None: the whole block in order) of block ``blk``, drawn on ``device`` in ``dtype`` from one
    generator per (block, part).

    ``into`` (whole blocks only): contiguous (BLOCK, m/2, d) and (BLOCK, m/2) destinations per
    half, drawn into in place (the same values as a fresh draw: no copy)."""
    d, k = u.shape
    whole = local is None
    v = torch.randn(
        BLOCK, k, generator=_generator(seed, _STREAM_PARTS, blk, 0, device=device), dtype=dtype, device=device
    )
    if local is not None:
        v = v[local]
    out: dict[int, tuple[Tensor, Tensor]] = {}
    for half in halves:
        a, b = half_range(samples, half)
        g = _generator(seed, _STREAM_PARTS, blk, 1 + half, device=device)
        if whole and into is not None:
            bx, y = into[half]
            torch.randn(BLOCK, b - a, d, generator=g, dtype=dtype, device=device, out=bx)
            torch.randn(BLOCK, b - a, generator=g, dtype=dtype, device=device, out=y)
            y.mul_(noise_std)
            torch.baddbmm(y.unsqueeze(-1), bx @ u, v.unsqueeze(-1), out=y.unsqueeze(-1))
        else:
            bx = torch.randn(BLOCK, b - a, d, generator=g, dtype=dtype, device=device)
            bz = torch.randn(BLOCK, b - a, generator=g, dtype=dtype, device=device)
            if local is not None:
                bx, bz = bx[local], bz[local]
            y = torch.baddbmm(noise_std * bz.unsqueeze(-1), bx @ u, v.unsqueeze(-1)).squeeze(-1)
        out[half] = (bx, y)
    with _COUNT_LOCK:
        DRAWN[str(dtype).removeprefix("torch.")] += BLOCK * len(halves)
    return v, out


def uses_parts_scheme(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """True when users are drawn per (block, part) in ``dtype`` on the device (float32, or any
    non-CPU device); False for the float64 CPU scheme that keeps every earlier run's users."""
    return dtype != torch.float64 or torch.device(device).type != "cpu"


def altmin_users(
    seed: int,
    ids: Tensor,
    u_star: Tensor,
    samples: int,
    noise_std: float,
    dtype: torch.dtype = torch.float64,
    *,
    halves: Iterable[int] = HALVES,
    device: torch.device | str = "cpu",
    workers: int | None = None,
    keep_partial_blocks: bool = True,
    compact: bool = False,
    parts: bool | None = None,
) -> dict[str, Tensor]:
    """x_ij ~ N(0, I_d), v*_j ~ N(0, I_k), y_ij = <U*ᵀx_ij, v*_j> + N(0, σ_F²) for the given user ids.

    ``halves`` says which sample halves (:func:`half_range`) are needed; the others are left
    zero (and, in the float32 scheme, not drawn). ``compact``: x and y hold only the asked-for
    halves' samples (m/2 of them for one half), so nothing is zero-filled or copied twice; in
    the float32 scheme whole blocks of sorted ids are drawn straight into place. ``workers``
    threads draw blocks at once (default: torch's thread count; 1 draws them in order: same
    bits). Off the CPU the users are drawn on ``device`` from (seed, block), with no host data.
    ``parts`` forces the (block, part) scheme (True) or the float64 host scheme (False);
    default :func:`uses_parts_scheme`. ``keep_partial_blocks``: keep a block asked for in part
    for the next caller (a Flower node of a few users); a pass that asks each block once turns it off.
    """
    device = torch.device(device)
    halves = tuple(sorted({int(h) for h in halves}))
    if not set(halves) <= set(HALVES):
        raise ValueError(f"halves must be a subset of {HALVES}; got {halves}")
    # the grouping into blocks is bookkeeping on the host's copy of the ids (no device read); the
    # device gets the ids, and the index of a partly asked-for block, by copies it does not wait for
    host = ids.to(torch.int64) if ids.device.type == "cpu" else ids.to(torch.int64).cpu()
    ids = to_device(host, device) if ids.device.type == "cpu" else ids.to(device, torch.int64)
    d, k = u_star.shape
    n = int(ids.shape[0])
    one_half = compact and len(halves) == 1
    width = samples // 2 if one_half else samples
    filled = one_half or halves == HALVES
    make = torch.empty if filled else torch.zeros
    x = make(n, width, d, dtype=dtype, device=device)
    y = make(n, width, dtype=dtype, device=device)
    v = torch.empty(n, k, dtype=dtype, device=device)
    if n == 0:
        return {"ids": ids, "x": x, "y": y, "v_star": v}
    blocks = host // BLOCK
    order = torch.argsort(blocks, stable=True)
    uniq, counts = torch.unique_consecutive(blocks[order], return_counts=True)
    groups = list(zip(uniq.tolist(), torch.split(order, counts.tolist())))
    parts = uses_parts_scheme(dtype, device) if parts is None else parts
    u = to_device(u_star, device).to(dtype if parts else torch.float64)

    def where(half: int) -> tuple[int, int]:
        return (0, width) if one_half else half_range(samples, half)

    def one(group: tuple[int, Tensor]) -> None:
        blk, rows = group
        local = host[rows] - blk * BLOCK
        if parts:
            r0 = int(rows[0])
            whole = local.numel() == BLOCK and bool((local == torch.arange(BLOCK)).all())  # the block, in order
            in_order = whole and rows.numel() == BLOCK and int(rows[-1]) - r0 == BLOCK - 1  # ... in consecutive rows
            in_place = one_half and in_order  # drawn straight into its rows
            into = {h: (x[r0 : r0 + BLOCK], y[r0 : r0 + BLOCK]) for h in halves} if in_place else None
            if in_order and not one_half and device.type == "cpu":
                # both halves: each drawn into this thread's reused buffers (the values of a fresh
                # draw), then one strided copy into its rows: no fresh pages, no index gather
                into = {
                    h: (
                        _scratch(f"x{h}", (BLOCK, b - a, d), dtype),
                        _scratch(f"y{h}", (BLOCK, b - a), dtype),
                    )
                    for h in halves
                    for a, b in (half_range(samples, h),)
                }
            # sorted ids (every chunk a pass makes) are consecutive rows of the chunk: slices of the device's
            # ids, no index to send
            span = rows.numel() == 1 or bool((rows[1:] - rows[:-1] == 1).all())
            at: Tensor | slice = slice(r0, r0 + rows.numel()) if span else to_device(rows, device)
            picked: Tensor | None = None  # the block's users asked for (None: all of them, in order)
            if not whole:
                picked = (
                    ids[r0 : r0 + rows.numel()] - blk * BLOCK
                    if span and device.type != "cpu"
                    else to_device(local, device)
                )
            bv, drawn = _parts_block(seed, blk, picked, u, samples, noise_std, halves, dtype, device, into)
            v[at] = bv
            for half, (hx, hy) in drawn.items():
                if in_place:
                    continue
                a, b = where(half)
                x[at, a:b] = hx
                y[at, a:b] = hy
            return
        xs, bv, bz = _user_block(
            seed, blk, samples, d, k, partial=keep_partial_blocks and rows.numel() < BLOCK, halves=halves
        )
        index: Tensor | slice = rows
        if (
            rows.numel() == BLOCK
            and int(rows[-1]) - int(rows[0]) == BLOCK - 1
            and bool((local == torch.arange(BLOCK)).all())
        ):
            index = slice(int(rows[0]), int(rows[0]) + BLOCK)  # a whole block in order: views, no gather
        else:
            xs, bv, bz = {h: t[local] for h, t in xs.items()}, bv[local], bz[local]
        v[index] = bv.to(dtype)
        for half in halves:
            a, b = half_range(samples, half)
            hx = xs[half]
            c, e = where(half)
            x[index, c:e] = hx.to(dtype)
            y[index, c:e] = ((hx @ u) @ bv.unsqueeze(-1)).squeeze(-1).add(noise_std * bz[:, a:b]).to(dtype)

    _map_blocks(one, groups, device, workers)
    return {"ids": ids, "x": x, "y": y, "v_star": v}


def _map_blocks(
    fn: Callable[[tuple[int, Tensor]], None],
    groups: list[tuple[int, Tensor]],
    device: torch.device,
    workers: int | None,
) -> None:
    """Run ``fn`` on every block group: on the CPU on a pool of single-threaded workers (blocks
    write disjoint rows, so the order does not matter), elsewhere in order (the device queues)."""
    threads = torch.get_num_threads()
    workers = threads if workers is None else workers
    if device.type != "cpu" or workers <= 1 or len(groups) == 1:
        for group in groups:
            fn(group)
        return
    from fedpers.pools import pool as _pool

    torch.set_num_threads(1)
    try:
        list(_pool(min(workers, len(groups))).map(fn, groups))
    finally:
        torch.set_num_threads(threads)
