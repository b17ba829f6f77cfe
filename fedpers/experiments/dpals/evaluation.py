"""What a DPALS run measures: test RMSE of the released item factors (each user solves its own embedding
locally) against the global and per-user means and a tuned non-private ALS."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedpers import linalg
from fedpers.configs.dpals import BASELINES, DpAlsConfig, baseline_names
from fedpers.data import ratings as data
from fedpers.experiments.base import Evaluator, derived_seed
from fedpers.experiments.dpals import baselines as rating_baselines
from fedpers.experiments.dpals.data import center, data_summary, load_units, n_items, n_users, table
from fedpers.protocols.base import State
from fedpers.protocols.dpals import DpAlsProtocol, residuals, user_embeddings, user_offsets

Tensor = torch.Tensor


def test_rmse(U: Tensor, units: dict[str, Tensor], ridge: float, mu: float = 0.0, user_bias: float = 0.0) -> float:
    """RMSE on the held-out ratings, each user solving its v on its training ratings (less μ and,
    with ``user_bias`` κ_u > 0, less its own offset b_j, added back to its predictions)."""
    U = U.double()
    r = units["ratings"].double() - mu
    offsets = user_offsets(r, units["mask"], user_bias) if user_bias > 0 else r.new_zeros(r.shape[0])
    v_unit, log_vn = user_embeddings(U, units["items"], residuals(r, offsets), units["mask"], ridge)
    v = v_unit * log_vn.exp().nan_to_num(0.0).unsqueeze(-1)
    pred = mu + offsets.unsqueeze(-1) + (U[units["items"]] * v.unsqueeze(1)).sum(-1)
    t = units["test"]
    err = (pred - units["ratings"].double())[t]
    return float(err.pow(2).mean().sqrt()) if err.numel() else math.nan


USER_MEAN_PRIOR = 5.0
"""κ of the user-mean baseline when the run itself has no user offsets (``user_bias`` 0)."""


def user_mean_rmse(units: dict[str, Tensor], mean: float, prior: float) -> float:
    """RMSE of μ + b_j on the held-out ratings: the global training mean plus each user's own
    offset (:func:`user_offsets`), no item learnt: what a user gets without the collaboration."""
    r = units["ratings"].double() - mean
    offsets = user_offsets(r, units["mask"], prior)
    err = (r - offsets.unsqueeze(-1))[units["test"]]
    return float(err.pow(2).mean().sqrt()) if err.numel() else math.nan


def subspace_distance(U: Tensor, U_star: Tensor) -> float:
    """||(I − P_U*) Q_U||_2: sine of the largest principal angle between the column spaces."""
    Q = linalg.orthonormal_basis(U.double())
    Qs = linalg.orthonormal_basis(U_star.double())
    return float(torch.linalg.matrix_norm(Q - Qs @ (Qs.T @ Q), ord=2))


ALS_KEYS = ("test_rmse", "ridge", "subspace_distance")
"""What the tuned non-private ALS reports (its row ``baselines.nonprivate_als``): the shared baseline ``als``."""


class DpAlsEvaluator(Evaluator):
    def __init__(self, cfg: DpAlsConfig, protocol: DpAlsProtocol) -> None:
        self.cfg, self.protocol = cfg, protocol
        self.units = load_units(cfg, torch.arange(n_users(cfg)), "cpu")
        self.synthetic = table(cfg) is None
        self.reused: dict[str, dict[str, Any]] = {}

    def reuse_baselines(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        unknown = sorted(set(rows) - {"als"})
        if unknown:
            raise ValueError(f"reuse_baselines: {unknown} are not shared baselines of this run (als)")
        self.reused = {name: dict(row) for name, row in rows.items()}

    def final_phase(self) -> str:
        return "the private result and its baselines" + (
            f" (the non-private reference, biased ALS: {len(rating_baselines.RIDGES)} ridges on a validation "
            "split, then a refit)"
            if "nonprivate_als" in baseline_names(self.cfg.baselines)
            else ""
        )

    def final(self, state: State) -> dict[str, Any]:
        cfg, u = self.cfg, self.units
        state = {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in state.items()}
        train = u["ratings"].double()[u["mask"]]
        test = u["ratings"].double()[u["test"]]
        mean = float(train.mean()) if train.numel() else 0.0
        mu = float(state["mu"]) if "mu" in state else 0.0
        # the competent non-private bar: biased ALS of the same rank on every training rating, its λ
        # chosen on a validation split of the training ratings (never on the test ratings)
        wanted = baseline_names(cfg.baselines)
        # computed by another run of these ratings and seed when a sweep hands it over ("als" reused)
        reused = self.reused.get("als") if "nonprivate_als" in wanted else None
        als = (
            rating_baselines.tuned(u, n_items(cfg), cfg.rank, seed=derived_seed(cfg.seed, "als"))
            if "nonprivate_als" in wanted and reused is None
            else None
        )
        out: dict[str, Any] = {
            "test_rmse": test_rmse(state["U"], u, cfg.ridge_user, mu, cfg.user_bias),
            "train_ratings": int(u["mask"].sum()),
            "test_ratings": int(u["test"].sum()),
        }
        baselines: dict[str, dict[str, Any]] = {
            "global_mean": {"test_rmse": float((test - mean).pow(2).mean().sqrt())},
            "user_mean": {"test_rmse": user_mean_rmse(u, mean, cfg.user_bias or USER_MEAN_PRIOR)},
        }
        if als is not None:
            baselines["nonprivate_als"] = {"test_rmse": als.test_rmse, "ridge": als.ridge}
        elif reused is not None:
            baselines["nonprivate_als"] = dict(reused)
        if "mu" in state:  # round 0's private releases, post-processed
            out["private_mean"] = mu + center(cfg)
            means = self.protocol.item_means(state)
            baselines["private_mean"] = {"test_rmse": float((test - mu).pow(2).mean().sqrt())}
            baselines["private_item_means"] = {
                "test_rmse": float(
                    (u["ratings"].double()[u["test"]] - means[u["items"][u["test"]]]).pow(2).mean().sqrt()
                )
            }
            out["head_items"] = int(state["head"].sum())
        t = table(cfg)
        if t is not None:
            out["users"], out["items"], out["users_excluded"] = t.n_users, t.n_items, t.excluded_users
        out["data"] = data_summary(cfg)
        if self.synthetic and cfg.rank >= cfg.true_rank:
            U_star = data.true_items(derived_seed(cfg.seed, "data"), cfg.n_items, cfg.true_rank)
            out["subspace_distance"] = (
                subspace_distance(state["U"][:, : cfg.true_rank] if cfg.rank == cfg.true_rank else state["U"], U_star)
                if cfg.rank == cfg.true_rank
                else math.nan
            )
            if als is not None:
                baselines["nonprivate_als"]["subspace_distance"] = (
                    subspace_distance(als.P, U_star) if cfg.rank == cfg.true_rank else math.nan
                )
        out["baselines"] = {name: row for name, row in baselines.items() if name in wanted}
        out["baselines_skipped"] = [name for name in BASELINES if name not in wanted]
        if reused is not None:
            out["baselines_reused"] = ["als"]
        return out
