"""`fedpers run dpals`: user-level private ALS for matrix completion (Chien et al. 2021).

Per-user clip scales: each of a user's (at most B) item contributions is scaled as if
||v|| ≤ c_v and |r| ≤ c_r, i.e. the user's whole G collection is clipped to Frobenius norm
Γ_G = √B·c_v² and its b collection to Γ_b = √B·c_r·c_v (clipping the whole contribution at
once, scale-safe, see :mod:`fedpers.protocols.dpals`). Noise: 2·T Gaussian releases with one
multiplier z, calibrated by the accountant to (ε, δ).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import dp_accounting
import torch

from fedpers import linalg
from fedpers.config import (
    device_path,
)
from fedpers.configs.dpals import DATASET_SCALES, DpAlsConfig, rating_scale
from fedpers.data import rating_files, summary
from fedpers.data import ratings as data
from fedpers.experiments import rating_baselines
from fedpers.experiments.base import Evaluator, Experiment, Trivial, derived_seed
from fedpers.experiments.hooks import BIG, Canaries, CanaryDesign
from fedpers.privacy import Calibrations, Ledger, calibrate_noise_multiplier, ledger_epsilon
from fedpers.protocols.dpals import DpAlsProtocol, residuals, triu_pack, user_embeddings, user_offsets

Tensor = torch.Tensor


def table(cfg: DpAlsConfig) -> rating_files.RatingTable | None:
    """The real rating data of ``cfg`` (None: synthetic)."""
    if cfg.ratings is None and not cfg.dataset:
        return None
    if cfg.ratings is not None and cfg.dataset:
        raise ValueError("give either ratings (a file) or dataset, not both")
    source = f"dataset:{cfg.dataset}" if cfg.dataset else str(cfg.ratings)
    declared = cfg.items is not None or bool(cfg.item_ids)
    universe = _universe(str(cfg.items) if cfg.items is not None else "", cfg.item_ids) if declared else None
    return rating_files.load_table(
        source,
        cfg.format,
        cfg.user_column,
        cfg.item_column,
        cfg.rating_column,
        *rating_scale(cfg),
        derived_seed(cfg.seed, "data"),
        cfg.test_fraction,
        cfg.max_ratings_per_user,
        universe,
    )


def center(cfg: DpAlsConfig) -> float:
    """The public constant subtracted from every rating: ``center``, or for a bundled data set
    left at 0 the midpoint of its scale, so the clip c_r acts on deviations, not on raw ratings
    (raw MovieLens ratings clipped at c_r = 2 bias the private mean from 3.5 to about 2)."""
    if cfg.center == 0 and cfg.dataset in DATASET_SCALES:
        lo, hi = DATASET_SCALES[cfg.dataset]
        return (lo + hi) / 2
    return cfg.center


@functools.lru_cache(maxsize=4)
def _universe(items_file: str, item_ids: str) -> tuple:
    return rating_files.item_universe(items_file or None, item_ids)


def data_summary(cfg: DpAlsConfig) -> dict[str, Any]:
    """What the run trains on, as the operator sees it (not a DP release)."""
    t = table(cfg)
    if t is None:
        return {"source": "synthetic", "users": cfg.n_users, "items": cfg.n_items, "note": rating_files.NOTE}
    source = (
        f"dataset {cfg.dataset} (its published catalogue as item universe)"
        if cfg.dataset and cfg.items is None and not cfg.item_ids
        else (f"dataset {cfg.dataset}" if cfg.dataset else str(cfg.ratings))
    )
    return {"source": source, **t.summary}


def n_items(cfg: DpAlsConfig) -> int:
    t = table(cfg)
    return cfg.n_items if t is None else t.n_items


def n_users(cfg: DpAlsConfig) -> int:
    t = table(cfg)
    return cfg.n_users if t is None else t.n_users


def bounds(cfg: DpAlsConfig) -> tuple[float, float]:
    """(Γ_G, Γ_b) = (√B·c_v², √B·c_r·c_v)."""
    sb = math.sqrt(cfg.items_per_user)
    cv = cfg.clip_embedding if cfg.clip_embedding > 0 else math.inf
    cr = cfg.clip_rating if cfg.clip_rating > 0 else math.inf
    return sb * cv**2, sb * cr * cv


def prelude(cfg: DpAlsConfig) -> bool:
    return cfg.private_center or cfg.head_items > 0


def releases(cfg: DpAlsConfig) -> int:
    """Gaussian releases touching a user: (G, b) per ALS round, plus round 0's sums and counts."""
    return 2 * cfg.steps + 2 * int(prelude(cfg))


def run_event(z: float, cfg: DpAlsConfig) -> dp_accounting.DpEvent:
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z)] * releases(cfg))


def initial_U(cfg: DpAlsConfig) -> Tensor:
    """Public random start (derived from the public seed, data-independent)."""
    g = torch.Generator().manual_seed(derived_seed(cfg.seed, "dpals-init"))
    return torch.randn(n_items(cfg), cfg.rank, generator=g, dtype=torch.float64) / math.sqrt(cfg.rank)


def make_protocol(cfg: DpAlsConfig, calibrations: Calibrations | None = None) -> DpAlsProtocol:
    g, b = bounds(cfg)
    z = 0.0
    if math.isfinite(cfg.epsilon):
        if not (math.isfinite(g) and math.isfinite(b)):
            raise ValueError("clip_embedding and clip_rating must be finite for a finite epsilon")
        z = calibrate_noise_multiplier(
            lambda m: run_event(m, cfg), cfg.epsilon, cfg.delta, calibrations=calibrations, neighbours=cfg.neighbours
        )
    return DpAlsProtocol(
        n_items=n_items(cfg),
        rank=cfg.rank,
        steps=cfg.steps,
        items_per_user=cfg.items_per_user,
        ridge_user=cfg.ridge_user,
        ridge_item=item_ridge(cfg, z),
        gram_bound=g,
        rhs_bound=b,
        noise_multiplier=z,
        initial_U=initial_U(cfg).to(cfg.device, getattr(torch, cfg.dtype)),
        dtype_name=cfg.dtype,
        prelude=prelude(cfg),
        head_items=cfg.head_items,
        rating_bound=math.sqrt(cfg.items_per_user) * (cfg.clip_rating if cfg.clip_rating > 0 else math.inf),
        user_bias=cfg.user_bias,
        device_kernels=device_path(cfg.device, cfg.kernels),
    )


def item_ridge(cfg: DpAlsConfig, z: float) -> float:
    """λ of the per-item solves: the configured one, or (auto) max(1, σ_G) with σ_G = 2·Γ_G·z the
    std of the noise on each entry of G_i: a ridge below it lets noise alone make U_i huge
    (measured: ε = 1, 20,000 users, λ = 1 gave test RMSE 8.0 against 0.99 for the global mean).
    Public: derived from the calibrated multiplier and the declared bound only."""
    if cfg.ridge_item > 0:
        return cfg.ridge_item
    return max(1.0, 2 * bounds(cfg)[0] * z) if z > 0 else 1.0


def load_units(cfg: DpAlsConfig, ids: Tensor, device: str | None = None) -> dict[str, Tensor]:
    """Users ``ids`` on ``device`` (the run's by default; the evaluator keeps its copy on the CPU)."""
    return {k: v.to(cfg.device if device is None else device) for k, v in _host_units(cfg, ids).items()}


_LAST_SYNTHETIC: dict[str, Any] = {}
"""The last synthetic users made in this process ("key": the generator's arguments, "ids",
"units"): a run's runtime and its evaluator each ask for every user, and drawing them (a Python
loop per user) is done once."""
_LAST_SYNTHETIC_LOCK = threading.Lock()


def _host_units(cfg: DpAlsConfig, ids: Tensor) -> dict[str, Tensor]:
    t = table(cfg)
    if t is not None:
        return t.units(ids, getattr(torch, cfg.dtype), center(cfg))
    # every argument of the draw but the ids: the key is what the users are a function of
    key = (
        derived_seed(cfg.seed, "data"),
        cfg.n_items,
        cfg.true_rank,
        cfg.min_count,
        cfg.max_count,
        cfg.popularity,
        cfg.noise_std,
        cfg.test_fraction,
        getattr(torch, cfg.dtype),
    )
    with _LAST_SYNTHETIC_LOCK:
        last = dict(_LAST_SYNTHETIC)
    if last.get("key") == key and torch.equal(last["ids"], ids):
        units = last["units"]
    else:
        units = data.synthetic_users(key[0], ids, *key[1:])
        with _LAST_SYNTHETIC_LOCK:
            _LAST_SYNTHETIC.update(key=key, ids=ids.clone(), units=units)
    return {k: v.clone() for k, v in units.items()}  # a copy: no caller shares another's tensors


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


class DpAlsEvaluator(Evaluator):
    def __init__(self, cfg: DpAlsConfig, protocol: DpAlsProtocol) -> None:
        self.cfg, self.protocol = cfg, protocol
        self.units = load_units(cfg, torch.arange(n_users(cfg)), "cpu")
        self.synthetic = table(cfg) is None

    def final_phase(self) -> str:
        return (
            "the private result, the global mean and the non-private reference (biased ALS: "
            f"{len(rating_baselines.RIDGES)} ridges on a validation split, then a refit)"
        )

    def final(self, state: Any) -> dict[str, Any]:
        cfg, u = self.cfg, self.units
        state = {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in state.items()}
        train = u["ratings"].double()[u["mask"]]
        test = u["ratings"].double()[u["test"]]
        mean = float(train.mean()) if train.numel() else 0.0
        mu = float(state["mu"]) if "mu" in state else 0.0
        # the competent non-private bar: biased ALS of the same rank on every training rating, its λ
        # chosen on a validation split of the training ratings (never on the test ratings)
        als = rating_baselines.tuned(u, n_items(cfg), cfg.rank, seed=derived_seed(cfg.seed, "als"))
        out: dict[str, Any] = {
            "test_rmse": test_rmse(state["U"], u, cfg.ridge_user, mu, cfg.user_bias),
            "global_mean_rmse": float((test - mean).pow(2).mean().sqrt()),
            "user_mean_rmse": user_mean_rmse(u, mean, cfg.user_bias or USER_MEAN_PRIOR),
            "als_rmse": als.test_rmse,
            "als_ridge": als.ridge,
            "train_ratings": int(u["mask"].sum()),
            "test_ratings": int(u["test"].sum()),
        }
        if "mu" in state:  # round 0's private releases, post-processed
            out["private_mean"] = mu + center(cfg)
            out["private_mean_rmse"] = float((test - mu).pow(2).mean().sqrt())
            means = self.protocol.item_means(state)
            out["private_item_means_rmse"] = float(
                (u["ratings"].double()[u["test"]] - means[u["items"][u["test"]]]).pow(2).mean().sqrt()
            )
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
            out["als_subspace_distance"] = subspace_distance(als.P, U_star) if cfg.rank == cfg.true_rank else math.nan
        return out


# ----- optional hook: audit canaries -------------------------------------------------------------
def audit_protocol(cfg: DpAlsConfig, k: int, calibrations: Calibrations | None = None) -> DpAlsProtocol:
    """The configured protocol for ``k`` canary users on synthetic items (with round 0 when
    ``private_center``/``head_items`` ask for it: :func:`round0_canaries`)."""
    if cfg.ratings is not None or cfg.dataset:
        raise ValueError(
            "ratings/dataset: the audit's population is its canaries (synthetic items); drop --ratings/--dataset"
        )
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)), calibrations)


def round0_canaries(protocol: DpAlsProtocol, generator: torch.Generator, count: int) -> Canaries:
    """With round 0 (item sums s and counts c): canary i rates B = items_per_user items, the block
    P_i = [2iB, (2i+1)B) at +BIG ("+") or the next block Q_i at −BIG ("−"). Its rating vector
    clips to ±c_r on each item, so s moves by c_r on 2B items and its total entry by 2√B·c_r:
    6Bc_r² of the (2Γ_s)² = 8Bc_r² sensitivity; c by 1 on 2B items, totals equal: 2B of 8B. Round
    0 together: exactly 1/√2 of its proven μ (s and c share z). The ALS rounds see the B ratings
    on different items (G, b ∝ r², sign-blind), as the one-rating design does."""
    p = protocol
    b = p.items_per_user
    if 2 * b * count > p.n_items:
        raise ValueError(f"canaries must be <= n_items/(2·items_per_user) = {p.n_items // (2 * b)}; got {count}")
    ids = torch.arange(count)
    block = torch.arange(b)
    ones = torch.ones(count, b, dtype=torch.float64)
    mask = torch.ones(count, b, dtype=torch.bool)
    test = torch.zeros(count, b, dtype=torch.bool)
    plus = {"ids": ids, "items": 2 * b * ids[:, None] + block, "ratings": (BIG * ones).to(p.dtype), "mask": mask}
    minus = {
        "ids": ids,
        "items": (2 * ids[:, None] + 1) * b + block,
        "ratings": (-BIG * ones).to(p.dtype),
        "mask": mask,
    }
    plus["test"], minus["test"] = test, test.clone()
    return Canaries(
        plus,
        minus,
        'B = items_per_user ratings per canary user: block 2i at +BIG ("+") or block 2i + 1 at −BIG ("−"); '
        "round 0's s at √(3/4) and c at 1/2 of their sensitivities; G and b on different items",
        released_statistic,
    )


def _canaries(protocol: DpAlsProtocol, generator: torch.Generator, count: int) -> Canaries:
    return (round0_canaries if protocol.prelude else audit_canaries)(protocol, generator, count)


def audit_canaries(protocol: DpAlsProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary i rates one item: item 2i ("+") or item 2i + 1 ("−"), rating BIG. With one rating
    v̂ = ±Û_item, so G_item = Γ_G v̂v̂ᵀ and b_item = Γ_b Û_item (both clips bind; the sign of the
    rating cancels in r·v): the versions' contributions sit on different items, √2·Γ apart, the
    most two one-rating users can be (G is PSD, b ∝ r²·U_item, so no rating flips them).
    G is released as block upper triangles: a block's share (1 + Σ v̂⁴)/2 of Γ_G² shows."""
    p = protocol
    if 2 * count > p.n_items:
        raise ValueError(f"canaries must be <= n_items/2 = {p.n_items // 2}; got {count}")
    ids = torch.arange(count)
    ratings = torch.full((count, 1), BIG, dtype=torch.float64).to(p.dtype)
    mask = torch.ones(count, 1, dtype=torch.bool)
    plus = {"ids": ids, "items": (2 * ids)[:, None], "ratings": ratings, "mask": mask}
    minus = {"ids": ids, "items": (2 * ids + 1)[:, None], "ratings": ratings, "mask": mask}
    return Canaries(
        plus,
        minus,
        'one rating per canary user, on item 2i ("+") or 2i + 1 ("−"): G and b at their clips, √2·Γ apart',
        released_statistic,
    )


def released_statistic(name: str, stat: Tensor) -> Tensor:
    """A client's statistic in the form the server releases it: G's full blocks as their upper
    triangles (what messages carry already passes unchanged)."""
    if name == "G" and stat.dim() == 3:
        return triu_pack(stat)
    return stat


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    lambda p: p.n_items // (2 * p.items_per_user if p.prelude else 2),
    _canaries,
    "round 0's item sums and counts (with private_center/head_items), every round's G (block upper triangles) and b",
    "replace-one user (a canary's two versions are the same user rating a different item)",
)


class DpAlsExperiment(Experiment[DpAlsConfig, DpAlsProtocol]):
    """DPALS on synthetic ragged rating data."""

    name = "dpals"
    result_keys = (
        "test_rmse",
        "global_mean_rmse",
        "user_mean_rmse",
        "als_rmse",
        "als_ridge",
        "train_ratings",
        "test_ratings",
        "private_mean",
        "private_mean_rmse",
        "private_item_means_rmse",
        "head_items",
        "users",
        "items",
        "users_excluded",
        "subspace_distance",
        "als_subspace_distance",
    )
    config_type = DpAlsConfig
    primary_metric = "test_rmse"

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
        return [Trivial("test_rmse", "global_mean_rmse", why=why), Trivial("test_rmse", "user_mean_rmse", why=alone)]

    def result_warnings(self, cfg: DpAlsConfig, result: Mapping[str, Any]) -> list[dict[str, Any]]:
        warnings = super().result_warnings(cfg, result)
        z = result.get("noise_multiplier", result.get("privacy", {}).get("noise_multiplier"))
        items, train = result.get("items", cfg.n_items), result.get("train_ratings")
        if isinstance(z, (int, float)) and z > 0 and isinstance(items, int) and isinstance(train, int) and items:
            sigma_b = 2 * bounds(cfg)[1] * z
            for w in warnings:
                if w.get("baseline") in ("global_mean_rmse", "user_mean_rmse"):  # the measured reason, in figures
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
