"""``fedpers run dpals``: user-level private ALS for matrix completion (Chien et al. 2021).

Per-user clip scales: each of a user's (at most B) item contributions is scaled as if
||v|| ≤ c_v and |r| ≤ c_r, i.e. the user's whole G collection is clipped to Frobenius norm
Γ_G = √B·c_v² and its b collection to Γ_b = √B·c_r·c_v (clipping the whole contribution at
once, scale-safe, see :mod:`fedpers.protocols.dpals`). Noise: 2·T Gaussian releases with one
multiplier z, calibrated by the accountant to (ε, δ)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedpers.configs.dpals import BASELINES, DpAlsConfig
from fedpers.data import summary
from fedpers.experiments.base import Experiment, Trivial
from fedpers.experiments.dpals.audit import CANARY_DESIGN
from fedpers.experiments.dpals.data import bounds, data_summary, load_units, n_users
from fedpers.experiments.dpals.evaluation import ALS_KEYS, DpAlsEvaluator
from fedpers.experiments.dpals.protocol import make_protocol, releases
from fedpers.experiments.hooks import CanaryDesign
from fedpers.privacy import Calibrations, Ledger, ledger_epsilon
from fedpers.protocols.dpals import DpAlsProtocol
from fedpers.results.quantities import Kind, Quantity

Tensor = torch.Tensor


class DpAlsExperiment(Experiment[DpAlsConfig, DpAlsProtocol]):
    """DPALS on synthetic ragged rating data."""

    name = "dpals"
    privacy_fields = ("epsilon", "delta", "neighbours")

    def shared_baselines(self, cfg: DpAlsConfig) -> tuple[str, ...]:
        """The tuned non-private ALS (its row ``baselines.nonprivate_als``, :data:`ALS_KEYS`)."""
        return ("als",)

    def shared_rows(self, cfg: DpAlsConfig, result: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
        row = result.get("baselines", {}).get("nonprivate_als")
        if not isinstance(row, Mapping) or "test_rmse" not in row:
            return None
        return {"als": {k: row[k] for k in ALS_KEYS if k in row}}

    result_keys = (
        "test_rmse",
        "subspace_distance",
        "train_ratings",
        "test_ratings",
        "private_mean",
        "head_items",
        "users",
        "items",
        "users_excluded",
    )
    baseline_names = BASELINES
    config_type = DpAlsConfig
    primary_metric = "test_rmse"
    quantities: ClassVar[Mapping[str, Quantity]] = {
        "test_rmse": Quantity(
            "test RMSE",
            "root mean squared error on held-out ratings, each user solving its own embedding locally",
            unit="rating",
        ),
        "subspace_distance": Quantity(
            "item-subspace distance", "sine of the largest principal angle between learnt and true item factors"
        ),
        "train_ratings": Quantity("training ratings", kind=Kind.DETAIL),
        "test_ratings": Quantity("held-out ratings", kind=Kind.DETAIL),
        "private_mean": Quantity("private mean rating", "μ̂ released by round 0", Kind.DETAIL),
        "head_items": Quantity("items learnt", "items with statistics (the head, or all)", Kind.DETAIL),
        "users": Quantity("users", kind=Kind.DETAIL),
        "items": Quantity("items", kind=Kind.DETAIL),
        "users_excluded": Quantity("users excluded", kind=Kind.DETAIL),
    }

    def trivial_baselines(self, cfg: DpAlsConfig) -> list[Trivial]:
        if math.isinf(cfg.epsilon):
            why = (
                "with no noise the loss comes from the clipping and the few ALS rounds: raise --clip-rating or "
                "--clip-embedding, run more --steps, or tune --ridge-user / --ridge-item; with uncentred ratings set "
                "--center to their public midpoint"
            )
        else:
            why = (
                "too few users for this ε: the noise on the per-item statistics swamps them (user-level DPALS needs "
                "10⁴–10⁶ users; raise --epsilon, use fewer --steps or --items-per-user, or learn only the popular items "
                "with --head-items H); with uncentred ratings set --center to their public midpoint"
            )
        alone = (
            "the item factors added nothing to each user's own mean rating: " + why
            if math.isfinite(cfg.epsilon)
            else "the item factors added nothing to each user's own mean rating: run more --steps or tune "
            "--ridge-user / --ridge-item"
        )
        return [Trivial("test_rmse", "global_mean", why=why), Trivial("test_rmse", "user_mean", why=alone)]

    def result_warnings(self, cfg: DpAlsConfig, result: Mapping[str, Any]) -> list[dict[str, Any]]:
        warnings = super().result_warnings(cfg, result)
        z = result.get("noise_multiplier", result.get("privacy", {}).get("noise_multiplier"))
        items, train = result.get("items", cfg.n_items), result.get("train_ratings")
        if isinstance(z, (int, float)) and z > 0 and isinstance(items, int) and isinstance(train, int) and items:
            sigma_b = 2 * bounds(cfg)[1] * z
            for w in warnings:
                if w.get("baseline") in ("global_mean", "user_mean"):  # the measured reason, in figures
                    w["text"] += (
                        f" [here: {train / items:.1f} training ratings per item on average ({train:,} over {items:,} "
                        f"items), each contributing at most c_r·c_v = {bounds(cfg)[1] / math.sqrt(cfg.items_per_user):.3g} "
                        f"to an item's b, against noise of std σ_b = 2·Γ_b·z = {sigma_b:.3g} on every entry]"
                    )
        data = result.get("data")
        for key in ("train_ratings", "test_ratings"):
            counted = data.get(key) if isinstance(data, Mapping) else None
            if counted is not None and result.get(key) is not None and counted != result[key]:
                warnings.append(
                    {"metric": key, "text": f"the data summary counts {key} = {counted} but the run used {result[key]}"}
                )
        return warnings

    def non_finite_cause(self, cfg: DpAlsConfig, result: Mapping[str, Any], metric: str) -> str:
        if result.get("test_ratings") == 0:
            return (
                "no held-out ratings (test_ratings = 0: every user has too few ratings for a test split); "
                "raise --test-fraction or use a file with more ratings per user"
            )
        if result.get("train_ratings") == 0:
            return "no training ratings (train_ratings = 0): check the data summary's dropped rows"
        return super().non_finite_cause(cfg, result, metric)

    def protocol(self, cfg: DpAlsConfig, calibrations: Calibrations | None = None) -> DpAlsProtocol:
        return make_protocol(cfg, calibrations)

    def num_units(self, cfg: DpAlsConfig) -> int:
        return n_users(cfg)

    def units(self, cfg: DpAlsConfig, ids: Tensor) -> dict[str, Tensor]:
        return load_units(cfg, ids)

    def evaluator(self, cfg: DpAlsConfig, protocol: DpAlsProtocol) -> DpAlsEvaluator:
        return DpAlsEvaluator(cfg, protocol)

    def privacy_summary(self, cfg: DpAlsConfig, protocol: DpAlsProtocol, ledger: Ledger) -> dict[str, Any]:
        return {
            "epsilon": ledger_epsilon(ledger, cfg.delta),
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": "pld",
            "neighbouring": f"{cfg.neighbours.value} user (all of its ratings)",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": protocol.noise_multiplier,
            "gram_bound": protocol.gram_bound,
            "rhs_bound": protocol.rhs_bound,
            "sensitivity": f"{cfg.neighbours.sensitivity_factor:g}·Γ per statistic ({cfg.neighbours.value}; "
            "the √2 PSD bound is not claimed)",
        }

    def plan(self, cfg: DpAlsConfig) -> list[str]:
        return summary.lines(data_summary(cfg))

    def describe(self, cfg: DpAlsConfig, protocol: DpAlsProtocol) -> dict[str, Any]:
        return {
            "gram_bound": protocol.gram_bound,
            "rhs_bound": protocol.rhs_bound,
            "noise_multiplier": protocol.noise_multiplier,
            "releases": releases(cfg),
            "sum_bound": protocol.sum_bound,
            "count_bound": protocol.count_bound,
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def reduced_config(self) -> dict[str, Any]:
        return {"n_users": 4000, "n_items": 20}
