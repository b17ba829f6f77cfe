"""``fedpers run altmin``: the experiment that ties AltMin's config, plan, protocol, evaluation and hooks
together for the runner, the Flower app, the audit and the sweeps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedpers.config import Neighbours
from fedpers.configs.altmin import BASELINES, AltMinConfig
from fedpers.configs.privacy import accountant_name
from fedpers.configs.shared import is_long_format
from fedpers.data import summary as data_summary
from fedpers.data.units import UnitSource
from fedpers.experiments.altmin.audit import CANARY_DESIGN
from fedpers.experiments.altmin.evaluation import AltMinEvaluator, shared_baselines
from fedpers.experiments.altmin.plan import resolve_plan
from fedpers.experiments.altmin.protocol import paper_epsilon
from fedpers.experiments.altmin.tuning import PRIVATE_SCORES
from fedpers.experiments.base import Experiment, Trivial
from fedpers.experiments.hooks import CanaryDesign, PrivateScore
from fedpers.privacy import Calibrations, Ledger, ledger_epsilon
from fedpers.protocols.altmin import AltMinProtocol

Tensor = torch.Tensor


def padding_warnings(cfg: AltMinConfig, result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What the declared per-user cap costs when the file's users hold far fewer rows: every user's
    statistics are bounded, and the noise sized, for ``--max-samples-per-user`` rows. The cap is the
    sensitivity, so it stays declared (a public bound the lab chooses), never read off the file; the
    operator-side data summary only tells the operator what it costs here."""
    data = result.get("data")
    if cfg.data is None or not is_long_format(cfg.data) or not isinstance(data, Mapping):
        return []
    cap, most = data.get("max_samples_per_user"), data.get("samples_per_user_max")
    if not isinstance(cap, int) or not isinstance(most, int) or most <= 0:
        return []
    train = most - math.floor(cfg.test_fraction * most)  # the most training rows any user keeps
    fits = max(4, 4 * math.ceil(train / 4))
    if fits >= cap:
        return []
    return [
        {
            "metric": "max_samples_per_user",
            "text": f"--max-samples-per-user {cap} bounds every user's statistics, and sizes the noise, as if each held "
            f"{cap} training rows, but the file's users hold at most {train} (after the {cfg.test_fraction:g} test "
            f"split; median {data.get('samples_per_user_median')} rows before it): the noise std is {cap // 4 / (fits // 4):.2g}× "
            f"what a cap of {fits} would need. The cap is the sensitivity, so it is declared, not read off the data: "
            f"if {fits} is a public bound on what any user holds, run with --max-samples-per-user {fits}",
        }
    ]


class AltMinExperiment(Experiment[AltMinConfig, AltMinProtocol]):
    """User-level private alternating minimisation with private initialisation (docs/algorithms.md §1, Algorithms 1–3)."""

    round_axis = "round (0 = private initialisation)"

    def trivial_baselines(self, cfg: AltMinConfig) -> list[Trivial]:
        """With a data file, n and m are the file's: the advice names only the flags that change the
        outcome for it (ε, the clip, the declared per-user cap), never --n-users or --samples-per-user."""
        if cfg.data is None:
            few = (
                "too few users for this ε: the noise on the round statistics swamps them (the privacy term falls as "
                "1/(ε²n²); raise --n-users or --epsilon, or try a smaller --clip-model c_η)"
            )
            alone = "; each user alone does better with --samples-per-user this large"
        else:
            few = (
                "the file's users are too few for this ε: the noise on the round statistics swamps them (the privacy "
                "term falls as 1/(ε²n²)); raise --epsilon, or try a smaller --clip-model c_η"
                + (
                    " or a declared --max-samples-per-user nearer the rows your users hold (it sizes the noise)"
                    if is_long_format(cfg.data)
                    else ""
                )
            )
            alone = "; each user alone does better with the rows the file gives it"
        return [
            Trivial("excess_risk", "local_only", why=few + alone),
            Trivial("excess_risk", "private_init_only", why="the private rounds made the initialisation worse: " + few),
        ]

    def result_warnings(self, cfg: AltMinConfig, result: Mapping[str, Any]) -> list[dict[str, Any]]:
        return super().result_warnings(cfg, result) + padding_warnings(cfg, result)

    name = "altmin"
    result_keys = ("subspace_error", "subspace_error_spectral", "excess_risk", "test_mse", "population_mse")
    baseline_names = BASELINES
    privacy_fields = ("epsilon", "delta", "accountant", "neighbours", "calibration")
    config_type = AltMinConfig

    def protocol(self, cfg: AltMinConfig, calibrations: Calibrations | None = None) -> AltMinProtocol:
        return resolve_plan(cfg).protocol(calibrations=calibrations)

    def shared_baselines(self, cfg: AltMinConfig) -> tuple[str, ...]:
        return shared_baselines(cfg)

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
