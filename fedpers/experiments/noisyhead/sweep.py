"""A NoisyHead sweep point: noisy GD on every repetition's statistics at once, its excess risks, its privacy
and the robustness attack's shift (``fedpers sweep simulations/noisyhead_*.toml``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedpers.configs.noisyhead import AttackNoise, NoisyHeadConfig, Unit
from fedpers.experiments.noisyhead.data import attack_prompt, sherman_morrison_replace
from fedpers.experiments.noisyhead.experiment import NoisyHeadExperiment
from fedpers.experiments.noisyhead.figures import sweep_figure
from fedpers.experiments.noisyhead.montecarlo import DirectStats, SpectralStats, engine_for, gamma_zero, statistics
from fedpers.experiments.noisyhead.protocol import Resolved, resolve
from fedpers.privacy import Privatizer, ledger_epsilon
from fedpers.protocols import noisyhead as nh
from fedpers.seeds import derived_seed, split_seed

Tensor = torch.Tensor


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
    gamma0 = gamma_zero(cfg, r, (stats.At if engine == "direct" else stats.e).device)
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


class NoisyHeadMonteCarloExperiment(NoisyHeadExperiment):
    """NoisyHead (the registered ``noisyhead``) with the sweep hooks of this module: ``fedpers sweep``
    batches every repetition of a point (:func:`sweep_point`) and draws :func:`sweep_figure`.
    The hooks live here, above :mod:`fedpers.experiments.noisyhead`, so neither module imports the other back."""

    def sweep_point(self, cfg: NoisyHeadConfig, repetitions: int) -> list[dict[str, float]]:
        return sweep_point(cfg, repetitions)

    def sweep_figure(self, rows: list[dict[str, Any]], spec: Any, out: Path) -> list[str] | None:
        return sweep_figure(rows, spec, out)
