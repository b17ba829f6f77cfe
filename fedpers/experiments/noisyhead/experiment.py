"""``fedpers run noisyhead`` (docs/algorithms.md §2): prompt-level DP pretraining of a linear attention head.

The config names the §6 setting (``regime``) that supplies λ, η₀ and T when they are not given,
derives C, G, G₀, R, σ from Theorem 4.1 unless given, calibrates the noise (the paper's per-step
(ε/T, δ/T) classical Gaussian, or the tight PLD accountant), and reports the test excess risk
against the ridge solution Γ*, the non-private GD after the same T, test MSEs and the privacy.
Monte-Carlo sweeps (``fedpers sweep simulations/noisyhead_*.toml``) go through
:meth:`NoisyHeadMonteCarloExperiment.sweep_point` (the registered experiment), which batches all
repetitions (:mod:`fedpers.experiments.noisyhead.montecarlo`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedpers import memory
from fedpers.config import Neighbours
from fedpers.configs.noisyhead import (
    BASELINES,
    Mode,
    NoisyHeadConfig,
    RidgeScaling,
)
from fedpers.configs.privacy import Calibration
from fedpers.experiments.base import Experiment, Trivial
from fedpers.experiments.hooks import CanaryDesign
from fedpers.experiments.noisyhead.audit import CANARY_DESIGN
from fedpers.experiments.noisyhead.data import load_units
from fedpers.experiments.noisyhead.evaluation import NoisyHeadEvaluator
from fedpers.experiments.noisyhead.protocol import make_protocol, resolve, step_event
from fedpers.privacy import (
    Calibrations,
    Ledger,
    calibrate_noise_multiplier,
    correlated,
    ledger_epsilon,
)
from fedpers.privacy.accountant import (
    accountant_name,
)
from fedpers.protocols import noisyhead as nh
from fedpers.protocols.noisyhead import FORMULAS, NoisyHeadProtocol
from fedpers.results.quantities import Kind, Quantity

Tensor = torch.Tensor


class NoisyHeadExperiment(Experiment[NoisyHeadConfig, NoisyHeadProtocol]):
    """NoisyHead: prompt-level DP gradient descent on a linear attention head (docs/algorithms.md §2)."""

    round_axis = "round (--mode rounds: one gradient step each)"

    name = "noisyhead"
    result_keys = (
        "excess_risk",
        "test_mse",
        "gamma_norm",
        "theorem41_bound",
        "robust_noisyhead",
        "robust_ridge",
        # a sweep's vectorised points (noisyhead_mc.sweep_point) also give these
        "gd_excess_risk",
        "ridge_test_mse",
        "gd_test_mse",
        "robust_ridge_naive_solve",
        "epsilon_spent",
        "paper_epsilon",
        "ridge_lambda",
        "step_size",
        "steps",
    )
    baseline_names = BASELINES
    quantities: ClassVar[Mapping[str, Quantity]] = {
        "excess_risk": Quantity(
            "excess risk",
            "mean over test prompts of ⟨Γ̂ − Γ*, Z⟩²: distance of the head's predictions from the ridge Γ*'s",
        ),
        "test_mse": Quantity("test MSE", "mean over test prompts of (⟨Γ̂, Z⟩ − y)²: the query label's squared error"),
        "gamma_norm": Quantity("‖Γ‖_F", "Frobenius norm of the head", Kind.DETAIL),
        "theorem41_bound": Quantity(
            "Theorem 4.1 bound",
            "the right side of (4.2), G₀²((1 − η₀λ)^T R² + σ²η₀²D T² log(2T/δ)/(N²ε²)): the excess risk's bound "
            "up to its constant",
            Kind.BOUND,
            bounds="excess_risk",
        ),
        "robust_noisyhead": Quantity(
            "NoisyHead's shift", "mean over test prompts of ⟨Γ̂ − Γ̂_bad, Z⟩²: NoisyHead moved by one attacked prompt"
        ),
        "robust_ridge": Quantity(
            "ridge's shift", "mean over test prompts of ⟨Γ* − Γ*_bad, Z⟩²: the ridge moved by one attacked prompt"
        ),
        "robust_ridge_naive_solve": Quantity("ridge's shift, naive solve", "as ridge's shift, by a direct solve"),
        "gd_excess_risk": Quantity("non-private GD's excess risk", "excess risk of GD without clipping or noise"),
        "ridge_test_mse": Quantity("ridge's test MSE", "test MSE of the ridge Γ*"),
        "gd_test_mse": Quantity("non-private GD's test MSE", "test MSE of GD without clipping or noise"),
        "epsilon_spent": Quantity("ε spent", "the ε the accountant gives the run's releases", Kind.DETAIL),
        "paper_epsilon": Quantity(
            "the paper's ε", "the ε the paper's calibration claims for the same noise", Kind.DETAIL
        ),
        "ridge_lambda": Quantity("ridge λ", "λ of the descended objective", Kind.DETAIL),
        "step_size": Quantity("step size η₀", "the gradient step", Kind.DETAIL),
        "steps": Quantity("steps T", "gradient steps", Kind.DETAIL),
        "attack_alpha": Quantity("attack α", "the attacked prompt's label shift α = c·N^p", Kind.DETAIL),
        "attacked_prompt": Quantity("attacked prompt", "index of the attacked prompt", Kind.DETAIL),
    }
    config_type = NoisyHeadConfig

    def trivial_baselines(self, cfg: NoisyHeadConfig) -> list[Trivial]:
        why = "the gradient noise swamps the signal: too few prompts N for this ε (raise --prompts or --epsilon"
        if cfg.calibration is Calibration.PAPER:
            why += "; --calibration accountant adds the smallest noise that meets (ε, δ), the paper's per-step rule adds far more"
        return [Trivial("excess_risk", "zero_head", why=why + ")")]

    def result_warnings(self, cfg: NoisyHeadConfig, result: Mapping[str, Any]) -> list[dict[str, Any]]:
        warnings = super().result_warnings(cfg, result)
        base = result.get("baselines", {})
        ridge, zero = base.get("ridge", {}).get("test_mse"), base.get("zero_head", {}).get("test_mse")
        if warnings and isinstance(ridge, float) and isinstance(zero, float) and ridge > 0.99 * zero:
            for w in warnings:  # the target itself is no better than predicting 0: say so, it is the real reason
                w["text"] += (
                    f"; note that the ridge target Γ* itself predicts no better than the zero head (test MSE "
                    f"{ridge:.4g} against {zero:.4g}): this regime's λ shrinks it to about 0, so lower --ridge-lambda "
                    "for a task with something to learn"
                )
        return warnings

    def protocol(self, cfg: NoisyHeadConfig, calibrations: Calibrations | None = None) -> NoisyHeadProtocol:
        self.plan(cfg)
        return make_protocol(cfg, calibrations=calibrations)

    def plan(self, cfg: NoisyHeadConfig) -> list[str]:
        """Prompts (train and test, float64) and the D²×D² statistics (sum, Γ* solve, eigenbasis)."""
        r = resolve(cfg)
        k = r.D * r.D
        need = {
            "prompts": (r.N + cfg.test_prompts) * (r.L + 1) * (r.D + 1) * 8 * 2,
            "statistics": k * k * 8 * 4 + min(cfg.chunk_size, r.N) * k * 8 * 4,
        }
        return memory.check_fits("noisyhead", need, "use fewer prompts or a smaller dimension D")

    def num_units(self, cfg: NoisyHeadConfig) -> int:
        return resolve(cfg).units

    def units(self, cfg: NoisyHeadConfig, ids: Tensor) -> dict[str, Tensor]:
        return load_units(cfg, ids)

    def evaluator(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol) -> NoisyHeadEvaluator:
        return NoisyHeadEvaluator(cfg, protocol)

    def privacy_summary(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol, ledger: Ledger) -> dict[str, Any]:
        r = resolve(cfg)
        eps = ledger_epsilon(ledger, cfg.delta, cfg.accountant)
        z = protocol.noise_multiplier
        out = {
            "epsilon": eps,
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": accountant_name(cfg.accountant),
            "calibration": cfg.calibration.value,
            "neighbouring": f"{cfg.neighbours.value} prompt"
            if r.P == 1
            else f"{cfg.neighbours.value} user ({r.P} prompts, statistics clipped per user)",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": z,
            "releases": len(ledger),
            "per_unit_bound": protocol.grad_bound,
            "sensitivity": cfg.neighbours.sensitivity_factor * protocol.grad_bound,
            "noise_std_sum": protocol.noise_std_sum,
            "noise_std_step": protocol.noise_std_step,
        }
        if cfg.neighbours is Neighbours.REPLACE_ONE:  # the paper's per-step rule is stated for replace-one
            out["paper_epsilon_same_noise"] = nh.paper_epsilon(z, r.T, cfg.delta)
        if protocol.adaptive:
            out["clip_rule"] = (
                f"adaptive γ={protocol.clip_quantile}, η_C={protocol.clip_lr}, count share f={protocol.count_share}"
            )
        if protocol.correlated is not None:
            out.update(correlated.summary(protocol.correlated))
        if cfg.mode is Mode.ROUNDS:
            cohorts = "poisson" if cfg.sampling_rate < 1 else cfg.cohorts
            out["sampling"] = correlated.sampling_text(
                cohorts, cfg.sampling_rate, protocol.cycle, protocol.sampling_rate
            )
        if not math.isinf(cfg.epsilon) and cfg.neighbours is Neighbours.REPLACE_ONE:
            paper_z = nh.paper_noise_multiplier(r.T, cfg.epsilon, cfg.delta)
            tight_z = (
                z
                if cfg.calibration is Calibration.ACCOUNTANT
                else calibrate_noise_multiplier(lambda v: step_event(v, r.T), cfg.epsilon, cfg.delta, cfg.accountant)
            )
            out["paper_noise_multiplier"] = paper_z
            out["accountant_noise_multiplier"] = tight_z
            out["paper_over_accountant_noise"] = paper_z / tight_z
        return out

    def plot_keys(self) -> tuple[str, ...]:
        return ("excess_risk",)

    def describe(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol) -> dict[str, Any]:
        r = resolve(cfg)
        values = {
            "N": r.N,
            "L": r.L,
            "D": r.D,
            "lambda": r.lam,
            "eta": r.eta,
            "T": r.T,
            "nu": r.consts.nu,
            "C": r.C,
            "G": r.G,
            "G0": r.consts.G0,
            "R": r.R,
            "sigma": 2 * r.G * (r.C + r.R * r.G),
            "noise_multiplier": r.noise_multiplier,
            "per_unit_bound": protocol.grad_bound,
            "noise_std_sum": protocol.noise_std_sum,
            "noise_std_step": protocol.noise_std_step,
            "step_sensitivity": protocol.step_sensitivity,
            "prompts_per_unit": r.P,
            "unit_clip": r.rho,
        }
        return {
            **values,
            "theorem41": {"C": r.consts.C, "G": r.consts.G, "G0": r.consts.G0, "R": r.consts.R},
            "formulas": {
                **r.formulas,
                "sigma": FORMULAS["sigma"],
                "per_unit_bound": "ρP·G(C + RG)",
                "step_sensitivity": "(η₀/N)·2ρP·G(C + RG)",
            },
            "mode": protocol.mode.value,
            "ridge": "vec Γ* = (2λN I + Σ vec Z vec Zᵀ)⁻¹ Σ y vec Z (matches GD's objective)"
            if cfg.ridge_scaling is RidgeScaling.MATCHED
            else "vec Γ* = (λN I + Σ vec Z vec Zᵀ)⁻¹ Σ y vec Z (eq. 2.7)",
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def reduced_config(self) -> dict[str, Any]:
        return {"prompts": 2000, "test_prompts": 200}
