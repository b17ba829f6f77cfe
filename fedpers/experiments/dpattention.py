"""`fedpers run dpattention`: DP attention by DPCovariance (docs/algorithms.md §4), with every precondition checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedpers import linalg, memory
from fedpers.configs.dpattention import BASELINES, DpAttentionConfig, data_norm, theorem_params
from fedpers.configs.shared import parse_baselines
from fedpers.data import attention as data
from fedpers.experiments.base import Evaluator, Experiment, Trivial, derived_seed
from fedpers.privacy import Calibrations, Ledger, ledger_epsilon
from fedpers.protocols.base import State
from fedpers.protocols.dpattention import DpAttentionProtocol, attention_matrix, entrywise_max_norm
from fedpers.results.quantities import Kind, Quantity

Tensor = torch.Tensor


params = theorem_params
"""The theorem's parameters of a config (:func:`fedpers.configs.dpattention.theorem_params`)."""


def load_units(cfg: DpAttentionConfig, ids: Tensor) -> dict[str, Tensor]:
    return data.columns(derived_seed(cfg.seed, "data"), ids, cfg.rows, data_norm(cfg), getattr(torch, cfg.dtype))


class DpAttentionEvaluator(Evaluator):
    """Compares the released attention with the exact one on the same (clipped) A."""

    def __init__(self, cfg: DpAttentionConfig, protocol: DpAttentionProtocol) -> None:
        self.cfg, self.protocol = cfg, protocol
        units = load_units(cfg, torch.arange(cfg.columns))
        self.A = protocol.client_update(0, {}, units).stats["A"].double()
        norms = torch.linalg.vector_norm(units["x"].double(), dim=-1)
        self.columns_clipped = int((norms > protocol.params.alpha * (1 + 1e-12)).sum())

    def final(self, state: State) -> dict[str, Any]:
        p = self.protocol.params
        A, B = self.A, state["B"].double()
        error = entrywise_max_norm(attention_matrix(A, self.protocol.f) - attention_matrix(B, self.protocol.f))
        vals, vecs = torch.linalg.eigh(A)
        a_inv_half = (vecs * vals.clamp_min(1e-300).rsqrt()) @ vecs.T
        rel = a_inv_half @ B @ a_inv_half
        eig_rel = torch.linalg.eigvalsh(linalg.sym(rel))
        return {
            "attention_error": error,
            "utility_bound": p.utility_bound,
            "bound_holds": bool(error <= p.utility_bound),
            "relative_error": float(torch.linalg.matrix_norm(rel - torch.eye(p.rows, dtype=rel.dtype))),
            "rho": p.rho,
            "within_1_pm_rho": bool(float((eig_rel - 1).abs().max()) <= p.rho),
            "k": p.k,
            "conditions": state["conditions"],
            "columns_clipped": self.columns_clipped,
            "baselines": {
                "uniform_attention": {
                    "attention_error": entrywise_max_norm(
                        attention_matrix(A, self.protocol.f) - torch.full_like(A, 1.0 / p.rows)
                    )
                }
            }
            if parse_baselines(self.cfg.baselines, BASELINES)
            else {},
            "baselines_skipped": [] if parse_baselines(self.cfg.baselines, BASELINES) else list(BASELINES),
        }


class DpAttentionExperiment(Experiment[DpAttentionConfig, DpAttentionProtocol]):
    """DP attention: DPCovariance release of XXᵀ and the attention D(B)⁻¹f(B)."""

    name = "dpattention"
    baseline_names = BASELINES
    result_keys = (
        "attention_error",
        "utility_bound",
        "bound_holds",
        "relative_error",
        "rho",
        "within_1_pm_rho",
        "k",
        "columns_clipped",
    )
    config_type = DpAttentionConfig
    primary_metric = "attention_error"
    quantities: ClassVar[Mapping[str, Quantity]] = {
        "attention_error": Quantity(
            "attention error", "max_ij |D(A)⁻¹f(A) − D(B)⁻¹f(B)|_ij: the released attention's largest entrywise error"
        ),
        "relative_error": Quantity("relative error", "‖A^{-1/2} B A^{-1/2} − I‖_F: B's error relative to A"),
        "utility_bound": Quantity(
            "Theorem 3.1 bound",
            "4(1 + ε + 2r)r: the attention error's bound, with probability 1 − γ",
            Kind.BOUND,
            bounds="attention_error",
        ),
        "bound_holds": Quantity("attention error within the bound", kind=Kind.DETAIL),
        "within_1_pm_rho": Quantity("(1 − ρ)A ⪯ B ⪯ (1 + ρ)A", kind=Kind.DETAIL),
        "rho": Quantity("ρ", "sqrt((n² + log(1/γ))/k) + (n² + log(1/γ))/k", Kind.DETAIL),
        "k": Quantity("Gaussian samples k", "DPCovariance's samples (the smallest with ρ < 0.1ε)", Kind.DETAIL),
        "columns_clipped": Quantity("columns clipped to α", kind=Kind.DETAIL),
    }

    def trivial_baselines(self, cfg: DpAttentionConfig) -> list[Trivial]:
        why = (
            "the DPCovariance noise exceeds the attention's own spread: too few samples k for this ε, or "
            "too little signal in XXᵀ (raise --k or --epsilon; check the preconditions above)"
        )
        return [Trivial("attention_error", "uniform_attention", why=why)]

    def protocol(self, cfg: DpAttentionConfig, calibrations: Calibrations | None = None) -> DpAttentionProtocol:
        self.memory_plan(cfg)
        return DpAttentionProtocol(params=params(cfg), f=cfg.f, dtype_name=cfg.dtype)

    @staticmethod
    def memory_plan(cfg: DpAttentionConfig) -> list[str]:
        """X (columns × rows, generated in float64, kept by the evaluator) and the n×n matrices."""
        need = {"columns": cfg.columns * cfg.rows * 8 * 3, "matrices": cfg.rows * cfg.rows * 8 * 8}
        return memory.check_fits("dpattention", need, "use fewer --columns or --rows")

    def num_units(self, cfg: DpAttentionConfig) -> int:
        return cfg.columns

    def units(self, cfg: DpAttentionConfig, ids: Tensor) -> dict[str, Tensor]:
        return load_units(cfg, ids)

    def evaluator(self, cfg: DpAttentionConfig, protocol: DpAttentionProtocol) -> DpAttentionEvaluator:
        return DpAttentionEvaluator(cfg, protocol)

    def privacy_summary(self, cfg: DpAttentionConfig, protocol: DpAttentionProtocol, ledger: Ledger) -> dict[str, Any]:
        p = protocol.params
        return {
            "epsilon": ledger_epsilon(ledger, cfg.delta),
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": "pld (the (ε, δ) stated by Theorem 3.1)",
            "neighbouring": f"β-close column (one column moved by at most β = {cfg.beta:g})",
            "mechanism": "DPCovariance: B = (1/k) Σ g gᵀ, g ~ N(0, A)",
            "k": p.k,
            "Delta": p.Delta,
            "sensitivity_2_alpha_beta_sqrt_n_over_eta": p.sensitivity,
            "rho": p.rho,
        }

    def describe(self, cfg: DpAttentionConfig, protocol: DpAttentionProtocol) -> dict[str, Any]:
        p = protocol.params
        return {
            "n": p.rows,
            "d": p.columns,
            "k": p.k,
            "alpha": p.alpha,
            "beta": p.beta,
            "eta": p.eta,
            "r": p.r,
            "gamma": p.gamma,
            "Delta": p.Delta,
            "sensitivity": p.sensitivity,
            "rho": p.rho,
            "utility_bound": p.utility_bound,
            "f": protocol.f.value,
            "data_column_norm": data_norm(cfg),
        }

    def plan(self, cfg: DpAttentionConfig) -> list[str]:
        p = params(cfg)
        return [
            *self.memory_plan(cfg),
            f"dpattention: n={p.rows}, d={p.columns}, k={p.k}; α={p.alpha:.4g}, "
            f"β={p.beta:.4g}, η={p.eta:.4g}, r={p.r:g}; "
            f"Δ={p.Delta:.4g}, 2αβ√n/η={p.sensitivity:.4g}, ρ={p.rho:.4g} (needs < {0.1 * p.epsilon:.4g})",
        ]

    def reduced_config(self) -> dict[str, Any]:
        return {"columns": 2000}
