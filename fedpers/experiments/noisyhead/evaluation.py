"""What a NoisyHead run measures: the test excess risk of the released Γ̂ against the ridge solution Γ*,
the non-private GD after the same T, test MSEs, and the robustness attack's shift."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from fedpers.configs.noisyhead import (
    BASELINES,
    AttackNoise,
    Mode,
    NoisyHeadConfig,
    baseline_names,
)
from fedpers.data import prompts as prompt_data
from fedpers.experiments.base import Evaluator, derived_seed
from fedpers.experiments.noisyhead.data import attack_prompt, group_units, prompts, sherman_morrison_replace
from fedpers.experiments.noisyhead.protocol import resolve
from fedpers.privacy import (
    Privatizer,
)
from fedpers.protocols import noisyhead as nh
from fedpers.protocols.base import State
from fedpers.protocols.noisyhead import NoisyHeadProtocol

Tensor = torch.Tensor


class NoisyHeadEvaluator(Evaluator):
    """Γ*, non-private GD and test metrics from the raw (unclipped) data of all N prompts."""

    def __init__(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol) -> None:
        self.cfg, self.protocol, self.r = cfg, protocol, resolve(cfg)
        N = self.r.N
        x, y = prompts(cfg, torch.arange(N, device=cfg.device))
        self.z, self.yq = nh.prompt_vectors(x, y)
        self.A, self.b = nh.gram_statistics(self.z, self.yq)
        self.gamma_star = nh.ridge(self.A, self.b, N, self.r.lam, cfg.ridge_scaling)
        xt, yt = prompts(cfg, torch.arange(cfg.test_prompts, device=cfg.device), test=True)
        self.z_test, self.y_test = nh.prompt_vectors(xt, yt)
        self._train = (x, y)

    def excess(self, gamma: Tensor, ref: Tensor | None = None) -> float:
        ref = self.gamma_star if ref is None else ref
        return float(((self.z_test @ (gamma.to(self.z_test) - ref)) ** 2).mean())

    def mse(self, gamma: Tensor) -> float:
        return float(((self.y_test - self.z_test @ gamma.to(self.z_test)) ** 2).mean())

    def round_metrics(self, round: int, state: State) -> dict[str, float]:
        return {"excess_risk": self.excess(state["gamma"])}

    def theorem_bound(self) -> float:
        """Right side of (4.2): G₀²((1 − η₀λ)^T R² + σ²η₀²D T² log(2T/δ)/(N²ε²)), σ = 2G(C + RG)."""
        r, cfg = self.r, self.cfg
        sigma = 2 * r.G * (r.C + r.R * r.G)
        scale = (r.N * cfg.epsilon) ** 2  # 0.0 once ε is so small that (Nε)² underflows: the bound is vacuous
        noise = (
            0.0
            if math.isinf(cfg.epsilon)
            else sigma**2 * r.eta**2 * r.D * r.T**2 * math.log(2 * r.T / cfg.delta) / scale
            if scale > 0
            else math.inf
        )
        return r.consts.G0**2 * ((1 - r.eta * r.lam) ** r.T * r.R**2 + noise)

    def final(self, state: State) -> dict[str, Any]:
        gamma = state["gamma"].to(self.z_test)
        r = self.r
        wanted = baseline_names(self.cfg.baselines)
        out: dict[str, Any] = {
            "excess_risk": self.excess(gamma),
            "test_mse": self.mse(gamma),
            "gamma_norm": float(torch.linalg.vector_norm(gamma)),
            "theorem41_bound": self.theorem_bound(),
            "Gamma": nh.vec_to_gamma(gamma).tolist(),
        }
        baselines: dict[str, dict[str, float]] = {}
        if "ridge" in wanted:
            baselines["ridge"] = {
                "excess_risk": 0.0,
                "test_mse": self.mse(self.gamma_star),
                "gamma_norm": float(torch.linalg.vector_norm(self.gamma_star)),
            }
        if "nonprivate_gd" in wanted:
            gamma0 = self.protocol.initial_gamma().to(self.z_test)
            gamma_gd = nh.gd(self.A, self.b, gamma0, r.N, r.lam, r.eta, r.T)
            baselines["nonprivate_gd"] = {"excess_risk": self.excess(gamma_gd), "test_mse": self.mse(gamma_gd)}
        if "zero_head" in wanted:
            baselines["zero_head"] = {
                "excess_risk": self.excess(torch.zeros_like(gamma)),
                "test_mse": self.mse(torch.zeros_like(gamma)),
            }
        out["baselines"] = baselines
        out["baselines_skipped"] = [name for name in BASELINES if name not in wanted]
        if self.cfg.attack_c > 0:
            out.update(self.robustness())
        return out

    def robustness(self) -> dict[str, float]:
        """§6.3 for this seed: rerun NoisyHead and the ridge with one prompt perturbed as in (5.1)."""
        from fedpers.runtime.local import run_local

        cfg, r = self.cfg, self.r
        i = int(torch.randint(r.N, (1,), generator=prompt_data.generator(derived_seed(cfg.seed, "attack"))))
        alpha = cfg.attack_c * r.N**cfg.attack_p
        x, y = self._train
        xb, yb = attack_prompt(x[i], y[i], cfg.attack_mu, alpha)
        zb, _ = nh.prompt_vectors(xb, yb)
        k = self.z.shape[-1]
        M_i = (
            self.A
            - torch.outer(self.z[i], self.z[i])
            + cfg.ridge_scaling.factor * r.lam * r.N * torch.eye(k, dtype=torch.float64, device=self.z.device)
        )
        ridge_bad = sherman_morrison_replace(M_i, self.b - self.yq[i] * self.z[i], zb, self.yq[i])
        x2, y2 = x.clone(), y.clone()
        x2[i], y2[i] = xb, yb
        units = group_units(x2, y2, r.P)
        # The runner's DP-noise seed is the server's secret, so the clean run is redone here
        # with the attacked run's noise (shared) or with independent noise.
        proto = replace(self.protocol, mode=Mode.STATISTICS)
        seed = derived_seed(cfg.seed, "robustness-noise")
        clean, _ = run_local(proto, group_units(x, y, r.P), Privatizer(seed, neighbours=cfg.neighbours), progress=False)
        if cfg.attack_noise is not AttackNoise.SHARED:
            seed = derived_seed(cfg.seed, "robustness-noise-attacked")
        state, _ = run_local(proto, units, Privatizer(seed, neighbours=cfg.neighbours), progress=False)
        return {
            "robust_noisyhead": self.excess(clean["gamma"], state["gamma"]),
            "robust_ridge": self.excess(self.gamma_star, ridge_bad),
            "attack_alpha": alpha,
            "attacked_prompt": i,
        }
