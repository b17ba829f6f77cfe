"""``fedpers run fedrep``: (private) FedRep with a private, accounted initialisation.

Synthetic users as AltMin's (x ~ N(0, I_d), y = ⟨U*ᵀx, v*_j⟩ + N(0, σ_F²); v*_j uniform on the
unit sphere by default, as in the paper, or N(0, I_k) as AltMin's),
each with m training samples (the only ones the protocol reads), R refit samples and S test
samples, all generated from (seed, user id). ``population_mse`` is the mean over users of the
test MSE after refitting v_j on the R refit samples with the final U (the paper's metric)."""

from __future__ import annotations

from typing import Any

import torch

from fedpers.configs.fedrep import BASELINES, FedRepConfig
from fedpers.configs.privacy import accountant_name
from fedpers.data.units import UnitSource
from fedpers.experiments.base import Experiment, Trivial
from fedpers.experiments.fedrep.audit import CANARY_DESIGN
from fedpers.experiments.fedrep.evaluation import FedRepEvaluator
from fedpers.experiments.fedrep.plan import correlated_summary, load_all, make_protocol, source
from fedpers.experiments.hooks import CanaryDesign
from fedpers.privacy import (
    Calibrations,
    Ledger,
    correlated,
    ledger_epsilon,
)
from fedpers.protocols.fedrep import FedRepProtocol

Tensor = torch.Tensor


class FedRepExperiment(Experiment[FedRepConfig, FedRepProtocol]):
    """Private FedRep (Snedeker, Zhou, Bassily 2025) with a private, accounted initialisation."""

    round_axis = "round (0 = private initialisation)"

    def trivial_baselines(self, cfg: FedRepConfig) -> list[Trivial]:
        why = (
            "the private gradient rounds made the initialisation worse: too few users for this ε and --rounds "
            "(raise --n-users or --epsilon, use fewer --rounds, or a --clip nearer the gradients' norms)"
        )
        return [
            Trivial("population_mse", "private_init_only", why=why),
            Trivial("subspace_error", "private_init_only", why=why),
        ]

    name = "fedrep"
    result_keys = ("subspace_error", "population_mse")
    baseline_names = ("oracle", "private_init_only", *BASELINES)
    config_type = FedRepConfig
    primary_metric = "population_mse"

    def protocol(self, cfg: FedRepConfig, calibrations: Calibrations | None = None) -> FedRepProtocol:
        return make_protocol(cfg, calibrations)

    def num_units(self, cfg: FedRepConfig) -> int:
        return cfg.n_users

    def units(self, cfg: FedRepConfig, ids: Tensor) -> dict[str, Tensor]:
        return {k: v for k, v in load_all(cfg, ids, test=False).items() if k in ("ids", "x", "y")}

    def unit_source(self, cfg: FedRepConfig) -> UnitSource:
        return source(cfg, ("ids", "x", "y"))

    def chunk_size(self, cfg: FedRepConfig) -> int:
        return cfg.chunk_size

    def evaluator(self, cfg: FedRepConfig, protocol: FedRepProtocol) -> FedRepEvaluator:
        return FedRepEvaluator(cfg)

    def privacy_summary(self, cfg: FedRepConfig, protocol: FedRepProtocol, ledger: Ledger) -> dict[str, Any]:
        return {
            "epsilon": ledger_epsilon(ledger, cfg.delta, cfg.accountant),
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": accountant_name(cfg.accountant),
            "neighbouring": f"{cfg.neighbours.value} user",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": protocol.noise_multiplier,
            "releases_per_user": protocol.releases_per_user(),
            "clip_rule": f"adaptive γ={protocol.clip_quantile}, η_C={protocol.clip_lr}, count share f={protocol.count_share}"
            if protocol.adaptive
            else "fixed",
            "sampling": correlated.sampling_text(cfg.cohorts, cfg.sampling_rate, protocol.cycle, protocol.sampling_rate)
            + (" (rounds 1..T; init uses every user)" if cfg.cohorts == "poisson" else ""),
            **correlated_summary(protocol),
        }

    def plot_keys(self) -> tuple[str, ...]:
        return ("subspace_error",)

    def describe(self, cfg: FedRepConfig, protocol: FedRepProtocol) -> dict[str, Any]:
        return {
            "clip": protocol.clip,
            "zeta": protocol.zeta,
            "noise_multiplier": protocol.noise_multiplier,
            "noise_std_G": protocol.round_noise_std(),
            "noise_std_init": protocol.noise_std(protocol.init_bound),
            "v_star": cfg.v_star.value,
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def reduced_config(self) -> dict[str, Any]:
        return {"n_users": 1000, "dim": 10, "test_samples": 20, "rounds": 2, "baselines": "none"}
