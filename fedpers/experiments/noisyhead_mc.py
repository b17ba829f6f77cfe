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
from pathlib import Path
from typing import Any

import torch

from fedpers.config import device_path
from fedpers.configs.noisyhead import AttackNoise, DataSource, Engine, NoisyHeadConfig, Unit
from fedpers.data import prompts as prompt_data
from fedpers.experiments.noisyhead import (
    NoisyHeadExperiment,
    Resolved,
    attack_prompt,
    initial_gamma,
    resolve,
    sherman_morrison_replace,
)
from fedpers.privacy import Privatizer, ledger_epsilon
from fedpers.protocols import noisyhead as nh
from fedpers.seeds import derived_seed, split_seed

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
    gamma0 = _gamma0(cfg, r, dev)
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


def _gamma0(cfg: NoisyHeadConfig, r: Resolved, device: torch.device | str = "cpu") -> Tensor:
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


def _quad(S: Tensor, v: Tensor) -> Tensor:
    return (v.unsqueeze(1) @ S @ v.unsqueeze(-1)).reshape(v.shape[0])


def _mean_sq(W: Tensor, v: Tensor) -> Tensor:
    return ((W @ v.to(W.dtype).unsqueeze(-1)).squeeze(-1).double() ** 2).mean(1)


def noisy_gd_direct(At: Tensor, bt: Tensor, gamma0: Tensor, r: Resolved, privatizer: Privatizer) -> Tensor:
    """Algorithm 1 for B repetitions at once (original coordinates); one batched release per step."""
    bound = r.rho * r.P * r.G * (r.C + r.R * r.G)
    gamma = gamma0.expand(At.shape[0], -1)
    for t in range(r.T):
        grad = (At @ gamma.unsqueeze(-1)).squeeze(-1) - bt
        noisy = privatizer.gaussian_sum_batched(
            grad, per_unit_bound=bound, noise_multiplier=r.noise_multiplier, name=f"step{t}", round=t
        )
        gamma = nh.descend(gamma, noisy, r.N, r.lam, r.eta, r.R)
    return gamma


def noisy_gd_spectral(e: Tensor, c: Tensor, v0: Tensor, r: Resolved, privatizer: Privatizer) -> Tensor:
    """Algorithm 1 in the eigenbasis of Ã (see the module docstring); O(B·D²) per step."""
    bound = r.rho * r.P * r.G * (r.C + r.R * r.G)
    v = v0
    for t in range(r.T):
        noisy = privatizer.gaussian_sum_batched(
            e * v - c, per_unit_bound=bound, noise_multiplier=r.noise_multiplier, name=f"step{t}", round=t
        )
        v = nh.descend(v, noisy, r.N, r.lam, r.eta, r.R)
    return v


def _privacy_rows(cfg: NoisyHeadConfig, r: Resolved, privatizer: Privatizer) -> dict[str, float]:
    eps = ledger_epsilon(privatizer.ledger, cfg.delta, cfg.accountant)
    return {
        "epsilon_spent": eps,
        "paper_epsilon": nh.paper_epsilon(r.noise_multiplier, r.T, cfg.delta),
        "noise_multiplier": r.noise_multiplier,
        "steps": float(r.T),
        "step_size": r.eta,
        "ridge_lambda": r.lam,
    }


def sweep_point(cfg: NoisyHeadConfig, repetitions: int) -> list[dict[str, float]]:
    """One row of metrics per repetition; every repetition computed in the same tensor operations."""
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1; got {repetitions}")
    if cfg.sampling_rate < 1:
        raise ValueError(
            "sampling_rate < 1 (Poisson sampling) is not simulated by the Monte-Carlo sweep engine, which "
            "reuses one sum of all units; run the points with fedpers run (mode rounds)"
        )
    if cfg.cohorts != "all" or cfg.noise != "independent":
        raise ValueError(
            "cohorts/noise: cyclic cohorts and correlated noise are not simulated by the Monte-Carlo sweep engine; "
            "run the points with fedpers run (mode rounds)"
        )
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: adaptive clipping is not simulated by the Monte-Carlo sweep engine; "
            "run the points with fedpers run (mode rounds)"
        )
    cfg, noise_seed = split_seed(cfg)  # like a run: data from the public seed, noise from a secret one
    r = resolve(cfg)
    engine = "direct" if cfg.attack_c > 0 else engine_for(cfg, r)
    if cfg.attack_c > 0 and cfg.unit is Unit.USER:
        raise ValueError("the robustness attack is implemented at the prompt level (unit=prompt)")
    stats = statistics(cfg, repetitions, engine)
    privatizer = Privatizer(
        noise_seed, neighbours=cfg.neighbours
    )  # the server's CPU generator; (B, D²) noise copied over
    gamma0 = _gamma0(cfg, r, (stats.At if engine == "direct" else stats.e).device)
    out: dict[str, Tensor] = {}
    if engine == "direct":
        st: DirectStats = stats
        gamma = noisy_gd_direct(st.At, st.bt, gamma0, r, privatizer)
        gd_error = _gd_error_direct(st, gamma0, r)  # Γ_GD − Γ*_matched, kept apart so tiny errors survive rounding
        gd = st.gmatch + gd_error
        out["excess_risk"] = _quad(st.S, gamma - st.gstar)
        out["gd_excess_risk"] = _quad(st.S, gd_error + (st.gmatch - st.gstar))
        for name, g in (("test_mse", gamma), ("ridge_test_mse", st.gstar), ("gd_test_mse", gd)):
            out[name] = _quad(st.S, g) - 2 * (st.s * g).sum(-1) + st.m
        if cfg.attack_c > 0:
            out.update(_robustness(cfg, r, st, gamma, gamma0, noise_seed))
    else:
        sp: SpectralStats = stats
        v = noisy_gd_spectral(sp.e, sp.c, sp.v0, r, privatizer)
        m_u = 1 - 2 * r.lam * r.eta - (r.eta / r.N) * sp.e_u
        gd_error = m_u.pow(r.T) * (sp.q0_u - sp.a_match)
        gd = sp.a_match + gd_error
        out["excess_risk"] = _mean_sq(sp.W, v - sp.vstar)
        out["gd_excess_risk"] = _mean_sq(sp.W_u, gd_error + (sp.a_match - sp.a_sel))
        for name, W, g in (("test_mse", sp.W, v), ("ridge_test_mse", sp.W_u, sp.a_sel), ("gd_test_mse", sp.W_u, gd)):
            out[name] = ((sp.y_test - (W @ g.to(W.dtype).unsqueeze(-1)).squeeze(-1).double()) ** 2).mean(1)
    common = _privacy_rows(cfg, r, privatizer)
    cols = {k: v.tolist() for k, v in out.items()}
    return [{**{k: cols[k][i] for k in cols}, **common} for i in range(repetitions)]


def _gd_error_direct(st: DirectStats, gamma0: Tensor, r: Resolved) -> Tensor:
    """Γ_GD^T − Γ*_matched = M^T(Γ⁰ − Γ*_matched), M = (1 − 2λη₀)I − (η₀/N)A, by T batched matvecs."""
    d = gamma0 - st.gmatch
    for _ in range(r.T):
        d = (1 - 2 * r.lam * r.eta) * d - (r.eta / r.N) * (st.A @ d.unsqueeze(-1)).squeeze(-1)
    return d


def _robustness(
    cfg: NoisyHeadConfig, r: Resolved, st: DirectStats, gamma: Tensor, gamma0: Tensor, noise_seed: int
) -> dict[str, Tensor]:
    """§6.3: the same repetitions with one prompt perturbed as in (5.1), for NoisyHead and the ridge."""
    alpha = cfg.attack_c * r.N**cfg.attack_p
    xb, yb = attack_prompt(st.x_att, st.y_att, cfg.attack_mu, alpha)
    ztb, _ = nh.prompt_vectors(xb, yb, r.C, r.G)
    zb, _ = nh.prompt_vectors(xb, yb)
    outer = lambda u: u.unsqueeze(-1) * u.unsqueeze(-2)  # noqa: E731
    At_bad = st.At - outer(st.zt_att) + outer(ztb)
    bt_bad = st.bt + st.yqt_att.unsqueeze(-1) * (ztb - st.zt_att)
    seed = noise_seed if cfg.attack_noise is AttackNoise.SHARED else derived_seed(noise_seed, "attacked")
    gamma_bad = noisy_gd_direct(At_bad, bt_bad, gamma0, r, Privatizer(seed, neighbours=cfg.neighbours))
    K = r.D * r.D
    eye = torch.eye(K, dtype=torch.float64, device=st.A.device)
    M_i = st.A - outer(st.z_att) + cfg.ridge_scaling.factor * r.lam * r.N * eye
    rhs_i = st.b - st.yq_att.unsqueeze(-1) * st.z_att
    ridge_bad = sherman_morrison_replace(M_i, rhs_i, zb, st.yq_att)
    naive = torch.linalg.solve(M_i + outer(zb), (rhs_i + st.yq_att.unsqueeze(-1) * zb).unsqueeze(-1)).squeeze(-1)
    return {
        "robust_noisyhead": _quad(st.S, gamma - gamma_bad),
        "robust_ridge": _quad(st.S, st.gstar - ridge_bad),
        "robust_ridge_naive_solve": _quad(st.S, st.gstar - naive),
        "attack_alpha": torch.full_like(st.m, alpha),
    }


# ----- figures ---------------------------------------------------------------------------------
def sweep_figure(rows: list[dict[str, Any]], spec: Any, out: Path) -> list[str] | None:
    """Custom layouts (``[plot] layout``): ``descent-privacy`` (§6.2, §7) and ``robustness`` (§6.3)."""
    layout = spec.plot.get("layout", "default")
    if layout == "default":
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedpers.results.summaries import summarise as _summarise

    def summarise(rows, spec, metric):
        return _summarise(rows, spec.series, spec.x, metric)

    if layout == "descent-privacy":
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
        descent = summarise(rows, spec, "gd_excess_risk")
        first = next(iter(descent.values()))  # GD does not depend on the series (ε or calibration)
        _band(axes[0], first, "non-private GD after T steps")
        _style(axes[0], spec, "cost of descent: (<Γ_GD − Γ*, Z>)²", spec.x, "excess risk")
        for s, pts in summarise(rows, spec, "excess_risk").items():
            _band(axes[1], pts, f"NoisyHead, {spec.series}={s}")
            best = min(pts, key=lambda p: p[1])
            print(
                f"  {spec.name}: cost of privacy at {spec.series}={s} is smallest at {spec.x}={best[0]:g} ({best[1]:.3g})"
            )
        xs, ms, _ = zip(*first)
        axes[1].plot(xs, ms, linestyle="--", color="grey", label="cost of descent")
        _style(axes[1], spec, "cost of privacy: (<Γ_DP − Γ*, Z>)²", spec.x, "excess risk")
    elif layout == "robustness":
        groups = sorted({row[spec.series] for row in rows})
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.2), squeeze=False)
        for ax, gval in zip(axes[0], groups):
            sub = [row for row in rows if row[spec.series] == gval]
            for metric, label in (
                ("robust_ridge", "ridge Γ*"),
                ("robust_noisyhead", "NoisyHead"),
                ("robust_ridge_naive_solve", "ridge, naive float64 solve"),
            ):
                for _, pts in summarise(sub, spec, metric).items():
                    _band(ax, pts, label, linestyle=":" if "naive" in metric else "-")
            _style(ax, spec, f"{spec.series} = {gval}", spec.x, "(<Γ − Γ_bad, Z>)²")
    else:
        raise ValueError(f"[plot] layout must be default, descent-privacy or robustness; got {layout!r}")
    fig.suptitle(f"{spec.name} (mean ± 2 s.e., B={spec.repetitions})")
    fig.tight_layout()
    name = f"{spec.name}.png"
    tmp = out / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out / name)
    return [name]


def _band(ax: Any, pts: list[tuple[float, float, float]], label: str, linestyle: str = "-") -> None:
    xs, ms, ses = (torch.tensor(c, dtype=torch.float64) for c in zip(*pts))
    (line,) = ax.plot(xs, ms, marker="o", markersize=3, label=label, linestyle=linestyle)
    lo = torch.where(ms - 2 * ses > 0, ms - 2 * ses, ms * 0.5)
    ax.fill_between(xs, lo, ms + 2 * ses, color=line.get_color(), alpha=0.2)


def _style(ax: Any, spec: Any, title: str, xlabel: str, ylabel: str) -> None:
    from fedpers.results.plots import grid_ticks

    grid_ticks(ax, [float(x) for line in ax.lines for x in line.get_xdata()], spec.plot.get("xscale", "linear"))
    ax.set_yscale(spec.plot.get("yscale", "log"))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


class NoisyHeadMonteCarloExperiment(NoisyHeadExperiment):
    """NoisyHead (the registered ``noisyhead``) with the sweep hooks of this module: ``fedpers sweep``
    batches every repetition of a point (:func:`sweep_point`) and draws :func:`sweep_figure`.
    The hooks live here, above :mod:`fedpers.experiments.noisyhead`, so neither module imports the other back."""

    def sweep_point(self, cfg: NoisyHeadConfig, repetitions: int) -> list[dict[str, float]]:
        return sweep_point(cfg, repetitions)

    def sweep_figure(self, rows: list[dict[str, Any]], spec: Any, out: Path) -> list[str] | None:
        return sweep_figure(rows, spec, out)
