"""``fedpers run altmin``: the experiment that ties AltMin's config, plan, protocol, evaluation and hooks
together for the runner, the Flower app, the audit and the sweeps."""

from __future__ import annotations

from typing import Any

import torch

from fedpers.config import Neighbours
from fedpers.configs.altmin import BASELINES, AltMinConfig
from fedpers.configs.privacy import accountant_name
from fedpers.data import summary as data_summary
from fedpers.data.units import UnitSource
from fedpers.experiments.altmin.audit import CANARY_DESIGN
from fedpers.experiments.altmin.evaluation import AltMinEvaluator
from fedpers.experiments.altmin.plan import resolve_plan
from fedpers.experiments.altmin.protocol import paper_epsilon
from fedpers.experiments.altmin.tuning import PRIVATE_SCORES
from fedpers.experiments.base import Experiment, Trivial
from fedpers.experiments.hooks import CanaryDesign, PrivateScore
from fedpers.privacy import Calibrations, Ledger, ledger_epsilon
from fedpers.protocols.altmin import AltMinProtocol

Tensor = torch.Tensor


class AltMinExperiment(Experiment[AltMinConfig, AltMinProtocol]):
    """User-level private alternating minimisation with private initialisation (docs/algorithms.md §1, Algorithms 1–3)."""

    round_axis = "round (0 = private initialisation)"

    def trivial_baselines(self, cfg: AltMinConfig) -> list[Trivial]:
        few = (
            "too few users for this ε: the noise on the round statistics swamps them (the privacy term falls as "
            "1/(ε²n²); raise --n-users or --epsilon, or try a smaller --clip-model c_η)"
        )
        return [
            Trivial(
                "excess_risk",
                "local_only",
                why=few + "; each user alone does better with --samples-per-user this large",
            ),
            Trivial("excess_risk", "private_init_only", why="the private rounds made the initialisation worse: " + few),
        ]

    name = "altmin"
    result_keys = ("subspace_error", "subspace_error_spectral", "excess_risk", "test_mse", "population_mse")
    baseline_names = BASELINES
    config_type = AltMinConfig

    def protocol(self, cfg: AltMinConfig, calibrations: Calibrations | None = None) -> AltMinProtocol:
        return resolve_plan(cfg).protocol(calibrations=calibrations)

    def num_units(self, cfg: AltMinConfig) -> int:
        return resolve_plan(cfg).cfg.n_users

    def units(self, cfg: AltMinConfig, ids: Tensor) -> dict[str, Tensor]:
        return {k: v for k, v in resolve_plan(cfg).load_units(ids).items() if k in ("ids", "x", "y")}

    def unit_source(self, cfg: AltMinConfig) -> UnitSource:
        return resolve_plan(cfg).source(("ids", "x", "y"))

    def chunk_size(self, cfg: AltMinConfig) -> int:
        return resolve_plan(cfg).cfg.chunk_size

    def evaluator(self, cfg: AltMinConfig, protocol: AltMinProtocol) -> AltMinEvaluator:
        return AltMinEvaluator(resolve_plan(cfg), protocol)

    def privacy_summary(self, cfg: AltMinConfig, protocol: AltMinProtocol, ledger: Ledger) -> dict[str, Any]:
        releases = protocol.releases_per_user()
        return {
            "epsilon": ledger_epsilon(ledger, cfg.delta, cfg.accountant),
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": accountant_name(cfg.accountant),
            "neighbouring": f"{cfg.neighbours.value} user",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": protocol.noise_multiplier,
            "releases_per_user": releases,
            "calibration": cfg.calibration.value,
            # Every release's σ = z·Δ/2 (its dp-accounting event is GaussianDpEvent(z)); the paper's rule is replace-one
            **(
                {
                    "paper_epsilon_same_noise": paper_epsilon(
                        protocol.noise_multiplier / 2, protocol.rounds_in, cfg.delta
                    )
                }
                if cfg.neighbours is Neighbours.REPLACE_ONE
                else {}
            ),
            **(
                {
                    "clip_rule": f"adaptive γ_η={protocol.clip_quantile}, γ_ζ={protocol.label_clip_quantile}, "
                    f"η_C={protocol.clip_lr}, count shares f_A={protocol.count_shares[0]}, f_b={protocol.count_shares[1]}"
                }
                if protocol.adaptive
                else {}
            ),
        }

    def plot_keys(self) -> tuple[str, ...]:
        return ("subspace_error",)

    def plan(self, cfg: AltMinConfig) -> list[str]:
        plan = resolve_plan(cfg)
        data = data_summary.lines(plan.file.summary()) if plan.file is not None else []
        return [*data, *plan.check_fits()]

    def describe(self, cfg: AltMinConfig, protocol: AltMinProtocol) -> dict[str, Any]:
        return {
            "eta": protocol.eta,
            "zeta": protocol.zeta,
            "eta_formula": "c_η √(dk)",
            "zeta_formula": "c_ζ √(k + σ_F²)",
            "noise_multiplier": protocol.noise_multiplier,
            "noise_std_init": protocol.noise_std(protocol.init_bound),
            "noise_std_A": protocol.noise_std(
                protocol.a_bound,
                protocol.a_sensitivity_of(protocol.a_bound, cfg.neighbours),
                neighbours=cfg.neighbours,
            ),
            "noise_std_b": protocol.noise_std(protocol.b_bound),
            "psd_method": protocol.psd.value,
            "chunk_size": resolve_plan(cfg).cfg.chunk_size,
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def private_scores(self) -> dict[str, PrivateScore]:
        return PRIVATE_SCORES

    def reduced_config(self) -> dict[str, Any]:
        return {"n_users": 10000, "samples_per_user": 12}
