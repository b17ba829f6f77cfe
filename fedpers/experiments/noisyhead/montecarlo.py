"""Batched Monte-Carlo for NoisyHead sweeps: all B repetitions of a grid point in one pass.

A repetition is an independent data set (N training prompts, ``test_prompts`` test prompts,
drawn from one generator for the whole batch, in memory-bounded chunks of repetitions), and
its own DP noise (one row of a (B, D²) Gaussian per step, drawn by
:meth:`~fedpers.privacy.Privatizer.gaussian_sum_batched`). Each repetition reduces to
sufficient statistics, so the T noisy steps cost O(B·D⁴) (``direct``) or O(B·D²) (``spectral``)
each, whatever N and L:

- ``direct`` (D ≤ 16): Ã = Σ vec Z̃ vec Z̃ᵀ and b̃ per repetition, steps in the original
  coordinates, exactly the arithmetic of the protocol's statistics mode. Needed by §6.3.
- ``spectral`` (large D, many steps): Ã = Q diag(e) Qᵀ once per data set; a step is then
  diagonal, ``v ← Π_R((1 − 2λη₀)v − (η₀/N)(e⊙v − Qᵀb̃ + ξ))`` with ``v = Qᵀ vec Γ``; the
  projection is unchanged because Q is orthogonal. The Privatizer releases the rotated
  gradient sum ``Qᵀ g`` with isotropic noise ξ: ``Q(Qᵀg + ξ) = g + Qξ`` and ``Qξ ~ N(0, σ²I)``
  whatever Q is, so every Γ^t has exactly Algorithm 1's distribution given the data (the
  release and its ledger record are the same Gaussian mechanism with the same bound).

The data statistics of the latest data set are cached, so a grid whose inner axis is ε, T or
the attack strength reuses them (common random numbers across that axis).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch

from fedpers.config import device_path
from fedpers.configs.noisyhead import DataSource, Engine, NoisyHeadConfig
from fedpers.data import prompts as prompt_data
from fedpers.experiments.noisyhead.protocol import Resolved, initial_gamma, resolve
from fedpers.protocols import noisyhead as nh
from fedpers.seeds import derived_seed

Tensor = torch.Tensor


CHUNK_ELEMENTS = 2**23
DEVICE_CHUNK_ELEMENTS = 2**27
"""Prompt-token elements per chunk: 2²³ on the CPU (host and device paths), 2²⁷ on a GPU
(about 6 GB of float64 working tensors at the §6.1 shapes)."""
REP_BLOCK = 8
"""Repetitions per device generator on the device path (see :func:`_device_draws`)."""
CACHE_BYTES = 6 * 2**30
DIRECT_MAX_DIM = 16
_CACHE: dict[tuple, Any] = {}


@dataclass
class DirectStats:
    """Per repetition, in the original coordinates (D² = K)."""

    At: Tensor  # (B, K, K) clipped Σ z̃ z̃ᵀ (per-user clipped at the user level)
    bt: Tensor  # (B, K)
    A: Tensor  # (B, K, K) raw Σ z zᵀ
    b: Tensor  # (B, K)
    gstar: Tensor  # (B, K) Γ* (selected ridge scaling)
    gmatch: Tensor  # (B, K) the matched ridge (GD's fixed point)
    S: Tensor  # (B, K, K) test second moment mean z zᵀ
    s: Tensor  # (B, K) mean y z
    m: Tensor  # (B,) mean y²
    x_att: Tensor  # (B, L+1, D) the prompt the §6.3 attacker perturbs
    y_att: Tensor  # (B, L+1)
    z_att: Tensor  # (B, K) its raw z
    zt_att: Tensor  # (B, K) its clipped z̃
    yq_att: Tensor  # (B,) its raw query label
    yqt_att: Tensor  # (B,) clipped


@dataclass
class SpectralStats:
    """Per repetition, in the eigenbases of Ã (clipped) and A (raw)."""

    e: Tensor  # (B, K) eigenvalues of Ã
    c: Tensor  # (B, K) Qᵀ b̃
    v0: Tensor  # (B, K) Qᵀ vec Γ⁰
    vstar: Tensor  # (B, K) Qᵀ vec Γ*
    W: Tensor  # (B, n_test, K) Z_test Q
    e_u: Tensor  # (B, K) eigenvalues of A
    a_sel: Tensor  # (B, K) Q_uᵀ Γ* (selected scaling)
    a_match: Tensor  # (B, K) Q_uᵀ Γ*_matched (GD's fixed point)
    q0_u: Tensor  # (B, K) Q_uᵀ vec Γ⁰
    W_u: Tensor  # (B, n_test, K) Z_test Q_u
    y_test: Tensor  # (B, n_test)


def engine_for(cfg: NoisyHeadConfig, r: Resolved) -> str:
    if cfg.engine is Engine.AUTO:
        return "direct" if r.D <= DIRECT_MAX_DIM else "spectral"
    return cfg.engine.value


def _cat(parts: list[Any]) -> Any:
    cls = type(parts[0])
    return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})


def _nbytes(stats: Any) -> int:
    return sum(getattr(stats, f.name).element_size() * getattr(stats, f.name).nelement() for f in fields(stats))


def _draw(
    cfg: NoisyHeadConfig, r: Resolved, g: torch.Generator, reps: int, n: int, test: bool
) -> tuple[Tensor, Tensor]:
    if cfg.data is DataSource.NEWSGROUPS:
        from fedpers.data import newsgroups

        return newsgroups.text_prompt_batch(g, cfg.seed, reps, n, r.L, r.D, test=test)
    return prompt_data.prompt_batch(g, reps, n, r.L, r.D, cfg.label_noise)


Draws = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
"""x, y (reps, N, L+1, D), (reps, N, L+1); test x, y; the index of the §6.3 attacked prompt (reps,)."""


def _host_draws(cfg: NoisyHeadConfig, r: Resolved, g: torch.Generator, reps: int) -> Draws:
    """Host path: the next ``reps`` data sets from the one CPU generator of the whole batch."""
    x, y = _draw(cfg, r, g, reps, r.N, test=False)
    xt, yt = _draw(cfg, r, g, reps, cfg.test_prompts, test=True)
    return x, y, xt, yt, torch.randint(r.N, (reps,), generator=g)


def _device_draws(cfg: NoisyHeadConfig, r: Resolved, start: int, reps: int, device: torch.device) -> Draws:
    """Device path: repetitions ``start .. start+reps−1`` drawn on ``device``.

    Repetitions come in blocks of :data:`REP_BLOCK`, block b from its own device generator keyed
    by (seed, b) and always drawn whole, so repetition i's data set depends on (seed, i) alone:
    the same for any chunking and any B. Real text (``data = newsgroups``) is sampled on the host
    from the same keys and copied (only synthetic data is drawn on the device).
    """
    seed = derived_seed(cfg.seed, "mc-data-device")
    text = cfg.data is DataSource.NEWSGROUPS
    parts: list[Draws] = []
    for blk in range(start // REP_BLOCK, (start + reps - 1) // REP_BLOCK + 1):
        g = prompt_data.device_generator(seed, blk, device="cpu" if text else device)
        drawn = _host_draws(cfg, r, g, REP_BLOCK) if text else _block_draws(cfg, r, g)
        lo, hi = (
            max(start, blk * REP_BLOCK) - blk * REP_BLOCK,
            min(start + reps, (blk + 1) * REP_BLOCK) - blk * REP_BLOCK,
        )
        parts.append(tuple(t[lo:hi].to(device) for t in drawn))  # type: ignore[arg-type]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(ts) for ts in zip(*parts))  # type: ignore[return-value]


def _block_draws(cfg: NoisyHeadConfig, r: Resolved, g: torch.Generator) -> Draws:
    x, y = prompt_data.prompt_batch(g, REP_BLOCK, r.N, r.L, r.D, cfg.label_noise)
    xt, yt = prompt_data.prompt_batch(g, REP_BLOCK, cfg.test_prompts, r.L, r.D, cfg.label_noise)
    return x, y, xt, yt, torch.randint(r.N, (REP_BLOCK,), generator=g, device=g.device)


def _chunk(cfg: NoisyHeadConfig, r: Resolved, draws: Draws, engine: str) -> Any:
    """The sufficient statistics of some data sets, on the device their draws live on."""
    x, y, xt, yt, att = draws
    reps, dev = x.shape[0], x.device
    N, K = r.N, r.D * r.D
    zt, yqt = nh.prompt_vectors(x, y, r.C, r.G)
    z, yq = nh.prompt_vectors(x, y)
    wa = wb = None
    if r.P > 1 or r.rho < 1:
        U = N // r.P
        ca, cb = nh.unit_clip_factors(
            zt.reshape(reps, U, r.P, K), yqt.reshape(reps, U, r.P), r.rho * r.P * r.G**2, r.rho * r.P * r.C * r.G
        )
        wa, wb = ca.repeat_interleave(r.P, dim=1), cb.repeat_interleave(r.P, dim=1)
    At, bt = nh.gram_statistics(zt, yqt, wa, wb)
    same = (zt == z).flatten(1).all(1) & (yqt == yq).all(1)
    if wa is not None:
        same = torch.zeros_like(same)
    A = At.clone()
    b = bt.clone()
    if not bool(same.all()):
        redo = (~same).nonzero().squeeze(1)
        A[redo], b[redo] = nh.gram_statistics(z[redo], yq[redo])
    zte, yte = nh.prompt_vectors(xt, yt)
    gamma0 = gamma_zero(cfg, r, dev)
    f = cfg.ridge_scaling.factor
    if engine == "direct":
        rows = torch.arange(reps, device=dev)
        return DirectStats(
            At=At,
            bt=bt,
            A=A,
            b=b,
            gstar=nh.ridge(A, b, N, r.lam, cfg.ridge_scaling),
            gmatch=nh.ridge(A, b, N, r.lam, nh.RidgeScaling.MATCHED),
            S=zte.transpose(1, 2) @ zte / cfg.test_prompts,
            s=(yte.unsqueeze(1) @ zte).squeeze(1) / cfg.test_prompts,
            m=(yte**2).mean(1),
            x_att=x[rows, att],
            y_att=y[rows, att],
            z_att=z[rows, att],
            zt_att=zt[rows, att],
            yq_att=yq[rows, att],
            yqt_att=yqt[rows, att],
        )
    del x, y, xt, yt, zt, z
    e, Q = eigh(At)
    e_u, Q_u = e.clone(), Q.clone()
    if not bool(same.all()):
        redo = (~same).nonzero().squeeze(1)
        e_u[redo], Q_u[redo] = eigh(A[redo])
    c_u = (Q_u.transpose(1, 2) @ b.unsqueeze(-1)).squeeze(-1)
    a_sel = c_u / (e_u + f * r.lam * N)
    gstar = (Q_u @ a_sel.unsqueeze(-1)).squeeze(-1)
    # The test projections are the largest tensors: float32 above D = 16 (risk to ~1e-6 relative).
    small = torch.float64 if K <= 256 else torch.float32
    W = zte.to(small) @ Q.to(small)
    W_u = W.clone()
    if not bool(same.all()):
        W_u[redo] = zte[redo].to(small) @ Q_u[redo].to(small)
    return SpectralStats(
        e=e,
        c=(Q.transpose(1, 2) @ bt.unsqueeze(-1)).squeeze(-1),
        v0=Q.transpose(1, 2) @ gamma0,
        vstar=(Q.transpose(1, 2) @ gstar.unsqueeze(-1)).squeeze(-1),
        W=W,
        e_u=e_u,
        a_sel=a_sel,
        a_match=c_u / (e_u + 2 * r.lam * N),
        q0_u=Q_u.transpose(1, 2) @ gamma0,
        W_u=W_u,
        y_test=yte,
    )


def gamma_zero(cfg: NoisyHeadConfig, r: Resolved, device: torch.device | str = "cpu") -> Tensor:
    """Γ⁰ (public: zero, or drawn from the public seed on the host, D² numbers) on ``device``."""
    return torch.tensor(initial_gamma(cfg, r) or [0.0] * (r.D * r.D), dtype=torch.float64, device=device)


def eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """Batched symmetric eigendecomposition: one batched call off the CPU; on the CPU,
    independent single-threaded LAPACK calls on worker threads.

    MKL's multi-threaded syevd slows down ~10× when the cores are shared with other work
    (measured: 6 s vs 0.5 s per 961×961 matrix), while independent matrices parallelise
    without synchronisation.
    """
    if m.device.type != "cpu":
        return torch.linalg.eigh(m)
    workers = max(1, min(torch.get_num_threads(), m.shape[0]))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(torch.linalg.eigh, m.chunk(workers)))
    finally:
        torch.set_num_threads(previous)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def on_device(cfg: NoisyHeadConfig) -> torch.device | None:
    """The device of the device code path (``kernels``), or None for the host path."""
    return torch.device(cfg.device) if device_path(cfg.device, cfg.kernels) else None


def chunk_repetitions(cfg: NoisyHeadConfig, r: Resolved, device: torch.device | None) -> int:
    """Repetitions per chunk (memory): a whole number of :data:`REP_BLOCK` on the device path."""
    budget = CHUNK_ELEMENTS if device is None or device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    per = max(1, budget // (r.N * (r.L + 1) * r.D + cfg.test_prompts * (r.L + 1) * r.D))
    return per if device is None else REP_BLOCK * max(1, per // REP_BLOCK)


def statistics(cfg: NoisyHeadConfig, repetitions: int, engine: str | None = None) -> Any:
    """The sufficient statistics of ``repetitions`` data sets (cached: the latest key only).

    Host path: drawn on the CPU from one generator, chunk after chunk. Device path
    (:func:`on_device`): drawn, reduced and kept on the run's device (:func:`_device_draws`):
    other data sets than the host path's, from the same distribution.
    """
    r = resolve(cfg)
    engine = engine or engine_for(cfg, r)
    if engine == "direct" and r.D > DIRECT_MAX_DIM:
        raise ValueError(
            f"engine=direct needs D ≤ {DIRECT_MAX_DIM} (D²×D² matrices per repetition); got D={r.D}; use engine=spectral"
        )
    device = on_device(cfg)
    key = (
        engine,
        device,
        cfg.data,
        cfg.seed,
        repetitions,
        r.N,
        r.L,
        r.D,
        cfg.label_noise,
        r.C,
        r.G,
        r.lam,
        cfg.ridge_scaling,
        r.P,
        r.rho,
        cfg.test_prompts,
        cfg.init,
        r.R if cfg.init.value == "gaussian" else None,
    )
    if key in _CACHE:
        return _CACHE[key]
    _CACHE.clear()
    per = chunk_repetitions(cfg, r, device)
    starts = range(0, repetitions, per)
    if device is None:
        g = prompt_data.generator(derived_seed(cfg.seed, "mc-data"), repetitions, r.N, r.L, r.D)
        parts = [_chunk(cfg, r, _host_draws(cfg, r, g, min(per, repetitions - a)), engine) for a in starts]
    else:
        parts = [_chunk(cfg, r, _device_draws(cfg, r, a, min(per, repetitions - a), device), engine) for a in starts]
    stats = _cat(parts)
    if _nbytes(stats) <= CACHE_BYTES:
        _CACHE[key] = stats
    return stats
