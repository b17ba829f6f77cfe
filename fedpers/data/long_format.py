"""Ragged per-user samples in long format (one row per sample) from Parquet or CSV, for AltMin.

Schema: a user column (any type; users are numbered 0..n−1 in sorted order of their ids), a
numeric label column, and numeric feature columns (by default every other numeric column).
Users may have any number of rows. Each user's rows are split, from a generator keyed by
(seed, user index) — public, so the split spends no privacy — into ⌊f·c⌋ test rows and the
rest; of those at most ``cap`` (a multiple of 4, the declared per-user bound) are kept, chosen
at random, in file order. The kept c' rows fill docs/algorithms.md §1's four parts contiguously, part r
taking ⌊c'/4⌋ + [r < c' mod 4] rows, each part zero-padded to cap/4: a zero sample adds nothing
to any local solve or statistic, so a user's contribution is bounded by the cap whatever its
count. Users with fewer than ``min_samples`` kept rows contribute nothing (they stay units, so
the number of users and the cohorts stay public) and are counted.

A malformed *file* is refused before any work: unreadable, a named column missing, no rows, or
(Parquet) a label/feature column whose declared type is not numeric — refused naming the column,
the first offending row and its value (with the default feature columns too: a column is never
silently left out). A CSV declares no types: every column is read as text and the run's flags
declare the label and features numeric, so a cell that does not read as a number is a problem of
its row, not of the file. A problem in one user's rows never refuses the file (the failure would
reveal the user): a row with a missing user id, a missing, NaN, infinite or (CSV) non-numeric
label or feature, or (CSV) the wrong number of cells is dropped and counted per reason in
:meth:`LongFormatFile.summary` (see docs/data.md). CSV user ids that all read as integers are
numbered in integer order, as a Parquet integer column is; otherwise in text order.

A Flower node reads only its users' rows (a Parquet scan with a pushed-down ``isin`` filter,
not a full copy); a local run loads the columns once, after a memory check.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import numpy as np
import torch

from fedpers import memory
from fedpers.data import summary

if TYPE_CHECKING:
    import pyarrow as pa

Tensor = torch.Tensor


class LongFormatSummary(TypedDict):
    """:meth:`LongFormatFile.summary`: descriptive counts of a long-format input (not a DP release)."""

    file: str
    rows: int
    rows_kept: int
    rows_dropped: dict[str, int]
    """Rows dropped, per reason."""
    users: int
    features: int
    feature_columns: list[str]
    users_below_minimum: int
    min_samples_per_user: int
    users_capped: int
    max_samples_per_user: int
    samples_per_user_median: float
    samples_per_user_max: int
    labels_beyond_robust_range: int
    """Kept labels beyond the robust range (:func:`fedpers.data.summary.robust_range`): kept (the private
    run clips every label at its declared ζ), but the non-private baselines use them as they are."""
    label_robust_range: list[float]
    note: str


class _Table(TypedDict):
    """Loaded rows of some users (every user with ``partial`` absent), sorted by user index then
    file order; the gather plan of :meth:`LongFormatFile._plan` is added once, in place."""

    present: np.ndarray
    """Indices of the users with loaded rows, sorted."""
    starts: np.ndarray
    ends: np.ndarray
    """Each present user's rows are ``x[starts[p]:ends[p]]``."""
    x: np.ndarray
    y: np.ndarray
    partial: NotRequired[bool]
    gather: NotRequired[np.ndarray]
    test_rows: NotRequired[list[np.ndarray]]
    test_counts: NotRequired[np.ndarray]
    x0: NotRequired[np.ndarray]
    y0: NotRequired[np.ndarray]


def quarter_sizes(count: int) -> list[int]:
    """Rows of each of the four parts for a user with ``count`` kept rows."""
    return [count // 4 + (r < count % 4) for r in range(4)]


class LongFormatFile:
    """A checked long-format file; :meth:`rows` gives padded (users, cap, d) blocks."""

    def __init__(
        self,
        path: str | Path,
        user_column: str,
        label_column: str,
        feature_columns: tuple[str, ...],
        *,
        cap: int,
        min_samples: int,
        test_fraction: float,
        seed: int,
    ) -> None:
        import pyarrow.dataset as ds

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"data: no such file {str(path)!r}")
        if cap < 4 or cap % 4:
            raise ValueError(f"max_samples_per_user must be a positive multiple of 4; got {cap}")
        if not 1 <= min_samples <= cap:
            raise ValueError(f"min_samples_per_user must be in [1, max_samples_per_user={cap}]; got {min_samples}")
        self.path, self.cap, self.min_samples, self.test_fraction, self.seed = (
            path,
            cap,
            min_samples,
            test_fraction,
            seed,
        )
        fmt = "csv" if path.suffix.lower() == ".csv" else "parquet"
        self.is_csv = fmt == "csv"
        self._bad_csv_rows: set[int] = set()
        try:
            if self.is_csv:  # every column as text: the flags declare the types, never a cell (docs/data.md)
                header = ds.dataset(str(path), format=self._csv_format(None)).schema.names
                self._dataset = ds.dataset(str(path), format=self._csv_format(header))
            else:
                self._dataset = ds.dataset(str(path), format=fmt)
            schema = self._dataset.schema
        except Exception as e:
            raise ValueError(f"data: cannot read {path.name} as {fmt} ({e})") from None
        names = list(schema.names)
        for flag, col in (
            ("user_column", user_column),
            ("label_column", label_column),
            *(("feature_columns", c) for c in feature_columns),
        ):
            if col not in names:
                raise ValueError(f"{flag}: no column {col!r} in {path.name} (columns: {', '.join(names)})")
        named = bool(feature_columns)
        if not feature_columns:
            feature_columns = tuple(c for c in names if c not in (user_column, label_column))
            if not feature_columns:
                raise ValueError(
                    f"feature_columns: {path.name} has no column besides {user_column!r} and {label_column!r}"
                )
        for flag, col in (("label_column", label_column), *(("feature_columns", c) for c in feature_columns)):
            if not self.is_csv and not _numeric(schema.field(col).type):
                hint = (
                    ""
                    if named or flag == "label_column"
                    else " (every column besides the user and label is a feature by default: name the ones to use with --feature-columns)"
                )
                raise ValueError(
                    f"{flag}: column {col!r} is {schema.field(col).type}, not numeric: {self._first_non_number(col)}{hint}"
                )
        if user_column in feature_columns or label_column in feature_columns:
            raise ValueError("feature_columns: must not include the user or label column")
        self.user_column, self.label_column, self.feature_columns = user_column, label_column, tuple(feature_columns)
        self.users, self.counts, self.rows_total = self._index()
        self._table: _Table | None = None

    # ----- shape ----------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.users)

    @property
    def dim(self) -> int:
        return len(self.feature_columns)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {"x": (self.n, self.cap, self.dim)}

    u_star = None

    def _csv_format(self, names: list[str] | None) -> Any:
        """CSV read with every column of ``names`` as raw bytes (empty and the usual null spellings
        read as missing; a byte that is not UTF-8 is only a cell that is not a number; None: the
        header alone is wanted) and a row with the wrong number of cells skipped, its line number
        recorded."""
        import pyarrow as pa
        import pyarrow.csv as pcsv
        import pyarrow.dataset as ds

        def skip(row: Any) -> str:
            self._bad_csv_rows.add(-1 - len(self._bad_csv_rows) if row.number is None else int(row.number))
            return "skip"

        return ds.CsvFileFormat(
            convert_options=pcsv.ConvertOptions(
                column_types={n: pa.binary() for n in names or ()}, strings_can_be_null=True, check_utf8=False
            ),
            parse_options=pcsv.ParseOptions(invalid_row_handler=skip),
        )

    def _first_non_number(self, col: str) -> str:
        """'row R holds V' for the first cell of ``col`` that is not a number (rows 1-based, after
        any header), and how many such cells there are."""
        row, first, count = 0, None, 0
        for batch in self._dataset.to_batches(columns=[col]):
            values = batch.column(0).to_pylist()
            for i, v in enumerate(values):
                if v is not None and not _is_number(v):
                    count += 1
                    if first is None:
                        first = (row + i + 1, v)
            row += len(values)
        if first is None:
            return "no cell holds a number"
        return f"row {first[0]} holds {first[1]!r} ({count} non-numeric cell(s))"

    def _valid(self, batch: pa.RecordBatch | pa.Table) -> tuple[np.ndarray, dict[str, np.ndarray], list[np.ndarray]]:
        """Rows of a (user, label, features...) batch that a user keeps, per reason the rows
        dropped (a missing user id, a label or feature that is not a number (CSV), or one that is
        missing, NaN or infinite; first reason wins), and the label's and features' float64
        values (every row), each column read once."""
        u = batch.column(0)
        ok = ~np.asarray(u.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        reasons = {"missing user id": ~ok}
        columns = []
        for i, col in enumerate((self.label_column, *self.feature_columns), start=1):
            values, not_number = _floats(batch.column(i))
            columns.append(values)
            kind = "label" if col == self.label_column else "feature"
            if not_number is not None:
                reasons[f"{kind} {col!r} not a number"] = bad = ok & not_number
                ok = ok & ~bad
            bad = ok & ~np.isfinite(values)
            reasons[f"{kind} {col!r} missing, NaN or infinite"] = bad
            ok = ok & ~bad
        return ok, reasons, columns

    def _ids(self, column: Any) -> np.ndarray:
        """User ids as :attr:`users` holds them (CSV text read as integers when every id is one)."""
        if self._int_ids:
            import pyarrow as pa

            column = column.cast(pa.int64())
        return column.to_numpy(zero_copy_only=False)

    def _index(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Users (sorted unique ids of every row with one) and kept rows per user, in one
        streamed pass (never the whole file in memory); dropped rows counted per reason."""
        users_parts, kept_parts, label_parts, total = [], [], [], 0
        self.rows_dropped: dict[str, int] = {}
        self._int_ids = False
        self._bad_csv_rows.clear()
        for batch in self._dataset.to_batches(columns=[self.user_column, self.label_column, *self.feature_columns]):
            total += batch.num_rows
            ok, reasons, values = self._valid(batch)
            for reason, bad in reasons.items():
                if bad.any():
                    self.rows_dropped[reason] = self.rows_dropped.get(reason, 0) + int(bad.sum())
            u = batch.column(0)
            users_parts.append(u.drop_null())
            kept_parts.append(u.filter(ok))
            label_parts.append(values[0][ok])
        if self._bad_csv_rows:
            self.rows_dropped["wrong number of cells"] = len(self._bad_csv_rows)
            total += len(self._bad_csv_rows)
        if total == 0:
            raise ValueError(f"data: {self.path.name} has no rows")
        self._int_ids = self.is_csv and bool(users_parts) and all(_integer_text(part) for part in users_parts)
        users = np.unique(np.concatenate([self._ids(part) for part in users_parts]))
        if len(users) == 0:
            raise ValueError(f"user_column: no row of {self.path.name} has a user id")
        kept = np.concatenate([self._ids(part) for part in kept_parts])
        labels = np.concatenate(label_parts)
        self.label_range = summary.robust_range(labels)
        self.labels_beyond = int(((labels < self.label_range[0]) | (labels > self.label_range[1])).sum())
        counts = (
            np.bincount(np.searchsorted(users, kept), minlength=len(users))
            if len(kept)
            else np.zeros(len(users), dtype=np.int64)
        )
        return users, counts, total

    # ----- reading ----------------------------------------------------------------------
    def _read(self, users: np.ndarray | None) -> _Table:
        """The rows of ``users`` (all with None) as a table sorted by user index, then file order."""
        import pyarrow.compute as pc

        columns = [self.user_column, self.label_column, *self.feature_columns]
        if users is None:
            need = self.rows_total * (self.dim + 3) * 8 * 2
            limit = memory.available_bytes()
            if limit > 0 and need > limit:
                raise ValueError(
                    f"data: loading {self.path.name} needs about {memory.human(need)} but {memory.human(limit)} is available"
                )
            table = self._dataset.to_table(columns=columns)
        else:
            field = pc.field(self.user_column)
            table = self._dataset.to_table(
                columns=columns, filter=(field.cast("int64") if self._int_ids else field).isin(list(self.users[users]))
            )
        import pyarrow as pa

        ok, _, values = self._valid(table)  # the rows _index counted
        index = np.searchsorted(self.users, self._ids(table.column(0).filter(pa.array(ok))))
        order = np.argsort(index, kind="stable")
        features = np.stack(values[1:], axis=1)[ok]
        label = values[0][ok]
        index = index[order]
        present = np.unique(index)
        starts = np.searchsorted(index, present)
        return {
            "present": present,
            "starts": starts,
            "ends": np.append(starts[1:], len(index)),
            "x": features[order],
            "y": label[order],
        }

    def load_all(self) -> None:
        """Read every row once (the local runtime's chunks then only slice)."""
        if self._table is None or self._table.get("partial"):
            self._table = self._read(None)

    def _rows_for(self, ids: np.ndarray) -> _Table:
        if self._table is None or (self._table.get("partial") and not np.isin(ids, self._table["present"]).all()):
            wanted = ids if self._table is None else np.union1d(ids, self._table["present"])
            self._table = {**self._read(np.unique(wanted)), "partial": True}
        return self._table

    def split(self, user: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(kept training rows, test rows) of a user's ``count`` rows, as positions in file order."""
        rng = np.random.Generator(np.random.Philox(key=[int(self.seed), int(user)]))
        n_test = math.floor(self.test_fraction * count)
        perm = rng.permutation(count)
        test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
        if len(train) > self.cap:
            train = np.sort(train[rng.permutation(len(train))[: self.cap]])
        if len(train) < self.min_samples:
            return train[:0], test[:0]
        return train, test

    def _plan(self, table: _Table) -> None:
        """Per loaded user, once: the table rows of its four padded parts (−1: padding) and of
        its test samples, so every later pass over the users is a gather."""
        if "gather" in table:
            return
        q = self.cap // 4
        gather = np.full((len(table["present"]), self.cap), -1, dtype=np.int64)
        test_rows, test_counts = [], np.zeros(len(table["present"]), dtype=np.int64)
        for p, user in enumerate(table["present"]):
            start, end = int(table["starts"][p]), int(table["ends"][p])
            train, test = self.split(int(user), end - start)
            offset = 0
            for r, size in enumerate(quarter_sizes(len(train))):
                gather[p, r * q : r * q + size] = start + train[offset : offset + size]
                offset += size
            test_rows.append(start + test)
            test_counts[p] = len(test)
        table["gather"], table["test_rows"], table["test_counts"] = gather, test_rows, test_counts
        table["x0"] = np.concatenate([table["x"], np.zeros((1, self.dim))])  # row −1: the zero sample
        table["y0"] = np.append(table["y"], 0.0)

    def rows(self, ids: Tensor) -> dict[str, Tensor]:
        """float64 padded blocks of the given users: x (u, cap, d), y (u, cap) in the four-part
        layout, x_test (u, t, d), y_test (u, t), test_count (u,), and ``ids``."""
        index = ids.to(torch.int64).cpu().numpy()
        if index.size and (index.min() < 0 or index.max() >= self.n):
            raise ValueError(f"data: user ids outside 0..{self.n - 1} of {self.path.name}")
        table = self._rows_for(index)
        self._plan(table)
        position = np.searchsorted(table["present"], index)
        position = np.minimum(position, len(table["present"]) - 1)
        found = table["present"][position] == index if len(table["present"]) else np.zeros(len(index), dtype=bool)
        gather = np.where(found[:, None], table["gather"][position], -1)
        counts = np.where(found, table["test_counts"][position], 0)
        width = max(1, int(counts.max()) if len(counts) else 1)
        test_gather = np.full((len(index), width), -1, dtype=np.int64)
        for row in np.flatnonzero(counts):
            test_gather[row, : counts[row]] = table["test_rows"][position[row]]
        x0, y0 = table["x0"], table["y0"]
        return {
            "x": torch.from_numpy(x0[gather]),
            "y": torch.from_numpy(y0[gather]),
            "x_test": torch.from_numpy(x0[test_gather]),
            "y_test": torch.from_numpy(y0[test_gather]),
            "test_count": torch.from_numpy(counts.astype(np.int64)),
            "ids": ids.to(torch.int64).cpu(),
        }

    def summary(self) -> LongFormatSummary:
        """Descriptive counts of the input file (computed by whoever holds it; not DP releases)."""
        n_test = np.floor(self.test_fraction * self.counts).astype(np.int64)
        train = self.counts - n_test
        kept = np.minimum(train, self.cap)
        return {
            "file": self.path.name,
            "rows": int(self.rows_total),
            "rows_kept": int(self.counts.sum()),
            "rows_dropped": dict(sorted(self.rows_dropped.items())),
            "users": self.n,
            "features": self.dim,
            "feature_columns": list(self.feature_columns),
            "users_below_minimum": int((kept < self.min_samples).sum()),
            "min_samples_per_user": self.min_samples,
            "users_capped": int((train > self.cap).sum()),
            "max_samples_per_user": self.cap,
            "samples_per_user_median": float(np.median(self.counts)),
            "samples_per_user_max": int(self.counts.max()),
            "labels_beyond_robust_range": self.labels_beyond,
            "label_robust_range": [float(f"{v:.4g}") for v in self.label_range],
            "note": summary.NOTE,
        }


def _is_number(v: Any) -> bool:
    """Whether a cell (of any column type) reads as a number."""
    if isinstance(v, (int, float)):
        return True
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _floats(column: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """(float64 values, missing as NaN; for a column of text or bytes (CSV) the cells that are not
    a number, as NaN too, and their mask, else None). A cell reads as Python's ``float`` reads it,
    whatever the other cells of the batch hold."""
    import pyarrow as pa
    import pyarrow.types as pt

    if not (pt.is_string(column.type) or pt.is_large_string(column.type) or pt.is_binary(column.type)):
        return column.cast("float64").fill_null(math.nan).to_numpy(zero_copy_only=False), None
    try:
        values = column.cast(pa.float64()).fill_null(math.nan).to_numpy(zero_copy_only=False)
        return values, np.zeros(len(values), dtype=bool)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        cells = column.to_pylist()
        values = np.full(len(cells), math.nan)
        not_number = np.zeros(len(cells), dtype=bool)
        for i, v in enumerate(cells):
            if v is None:
                continue
            try:
                values[i] = float(v)
            except ValueError:
                not_number[i] = True
        return values, not_number


def _integer_text(ids: Any) -> bool:
    """Whether every id of a CSV's array of ids (bytes, no nulls) reads as an int64 (other arrays: False)."""
    import pyarrow.compute as pc
    import pyarrow.types as pt

    if not pt.is_binary(ids.type):
        return False
    return pc.all(pc.match_substring_regex(ids, r"^-?[0-9]{1,18}$")).as_py() is not False


def _numeric(dtype: pa.DataType) -> bool:
    import pyarrow.types as pt

    return pt.is_integer(dtype) or pt.is_floating(dtype) or pt.is_boolean(dtype) or pt.is_decimal(dtype)
