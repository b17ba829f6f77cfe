"""DPALS's ratings: a declared rating file or bundled data set (its public item universe and scale), or
synthetic users drawn from (seed, user id), loaded for any subset of users."""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import torch

from fedpers.configs.dpals import DATASET_SCALES, DpAlsConfig, rating_scale
from fedpers.data import rating_files
from fedpers.data import ratings as data
from fedpers.experiments.base import derived_seed

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
