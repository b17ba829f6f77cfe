"""Per-user data from a file: one ``.npz`` schema, checked before any work.

Arrays (n users, m samples each, d features):

- ``x``       float (n, m, d)   required; m divisible by 4
- ``y``       float (n, m)      required
- ``u_star``  float (d, k)      optional true subspace (enables subspace metrics)
- ``v_star``  float (n, k)      optional true personal vectors (with ``u_star``: excess risk)
- ``x_test``  float (n, t, d)   optional held-out samples per user (test MSE)
- ``y_test``  float (n, t)      required with ``x_test``

A malformed file (unreadable, unknown or missing array, wrong shape or dtype, non-finite
``u_star``/``v_star``) is refused before any work. A NaN/inf in one user's samples never
refuses the file (that failure would reveal the user): the sample (its x row and its y) is
zeroed — a zero sample adds nothing to any solve or statistic — and counted per array in
:meth:`AltMinFile.summary` (see docs/data.md).
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch
from numpy.lib import format as npy_format

from fedpers import memory
from fedpers.data import summary

Tensor = torch.Tensor
REQUIRED = ("x", "y")
ORTHONORMAL_TOLERANCE = 1e-6
OPTIONAL = ("u_star", "v_star", "x_test", "y_test")
SAMPLES = ("x", "y", "x_test", "y_test")
"""Per-user sample arrays: a non-finite sample is zeroed and counted, never refusing the file."""


class FileSummary(TypedDict):
    """:meth:`AltMinFile.summary`: descriptive counts of an ``.npz`` input (not a DP release)."""

    file: str
    users: int
    samples_per_user: int
    features: int
    samples_zeroed: dict[str, int]
    """Non-finite samples zeroed, per array."""
    labels_beyond_robust_range: int
    """Finite labels (y, y_test) outside the robust range of ``y`` (see
    :func:`fedpers.data.summary.robust_range`): kept, but the non-private baselines fit them as they are."""
    label_robust_range: list[float]
    note: str


def inspect_npz(path: Path, streamed: bool = False) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each member's name, shape and dtype from the zip directory and the .npy headers: nothing
    is inflated, so a small file with a huge or unexpected member is refused at no cost.
    ``streamed``: the file is read in row blocks, so its size is not held against memory."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"data: cannot read {str(path)!r} as .npz ({e})") from None
    members: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    with archive:
        for info in archive.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            if name not in REQUIRED + OPTIONAL:
                raise ValueError(f"data: unknown array {name!r} in {path.name}; allowed: {list(REQUIRED + OPTIONAL)}")
            try:
                with archive.open(info) as f:
                    version = npy_format.read_magic(f)
                    header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
                    shape, _, dtype = header(f)
            except Exception as e:
                raise ValueError(f"data: {name} in {path.name} is not a readable .npy array ({e})") from None
            if dtype.kind == "c":
                raise ValueError(f"data: {name} is complex-valued ({dtype}); only real numbers are allowed")
            if dtype.kind not in "biuf":
                raise ValueError(f"data: {name} must be numeric; got dtype {dtype}")
            members[name] = (tuple(shape), dtype)
    need = sum(math.prod(shape) * (dtype.itemsize + 8) for shape, dtype in members.values())
    limit = memory.available_bytes()
    if not streamed and limit > 0 and need > limit:
        raise ValueError(
            f"data: loading {path.name} needs about {memory.human(need)} but {memory.human(limit)} is available"
        )
    return members


class AltMinFile:
    """A checked ``.npz`` of the schema above whose rows are read on demand.

    Members stored uncompressed (``np.savez``) are memory-mapped: checking them streams
    through the file in row blocks, and :meth:`rows` copies out only the rows asked for, so a
    run over the file never holds more than one chunk of it (nor does a Flower node more than
    its own users). Compressed (``np.savez_compressed``) or Fortran-ordered members are
    inflated once and kept.
    """

    CHECK_ROWS = 4096

    def __init__(self, path: str | Path, rank: int) -> None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"data: no such file {str(path)!r}")
        self.path, self.rank = path, rank
        members = inspect_npz(path, streamed=_all_stored(path))
        missing = [k for k in REQUIRED if k not in members]
        if missing:
            raise ValueError(f"data: {path.name} lacks required array(s) {missing}; schema: x (n,m,d), y (n,m)")
        self.shapes = {k: shape for k, (shape, _) in members.items()}
        self._members = members
        self._check_shapes()
        self._arrays: dict[str, np.ndarray | _StoredRows] = {}
        self.samples_zeroed: dict[str, int] = {}
        for name in members:
            self._arrays[name] = self._open(name)
            self._check_finite(name)
        self._count_label_outliers()
        self.u_star = (
            torch.from_numpy(_slice(self._arrays["u_star"], 0, self.shapes["u_star"][0]).astype(np.float64))
            if "u_star" in members
            else None
        )
        if self.u_star is not None:
            gap = float(
                (self.u_star.T @ self.u_star - torch.eye(self.u_star.shape[1], dtype=torch.float64)).abs().max()
            )
            if gap > ORTHONORMAL_TOLERANCE:
                raise ValueError(
                    f"data: u_star must have orthonormal columns (max |UᵀU − I| = {gap:.3g} > {ORTHONORMAL_TOLERANCE:g})"
                )

    @property
    def n(self) -> int:
        return int(self.shapes["x"][0])

    def _check_shapes(self) -> None:
        shapes = self.shapes
        if len(shapes["x"]) != 3:
            raise ValueError(f"data: x must have shape (n, m, d); got {shapes['x']}")
        n, m, d = shapes["x"]
        expected = {"y": (n, m), "u_star": (d, self.rank), "v_star": (n, self.rank)}
        if "x_test" in shapes:
            xt = shapes["x_test"]
            if len(xt) != 3 or xt[0] != n or xt[2] != d:
                raise ValueError(f"data: x_test must have shape ({n}, t, {d}); got {xt}")
            if xt[1] < 1:
                raise ValueError(f"data: x_test must hold t >= 1 samples per user; got shape {xt}")
            expected["y_test"] = xt[:2]
        elif "y_test" in shapes:
            raise ValueError("data: y_test given without x_test")
        for name, shape in expected.items():
            if name in shapes and tuple(shapes[name]) != tuple(shape):
                raise ValueError(f"data: {name} must have shape {tuple(shape)}; got {shapes[name]}")
        if "v_star" in shapes and "u_star" not in shapes:
            raise ValueError("data: v_star given without u_star")
        if m % 4 != 0 or m < 4:
            raise ValueError(f"data: samples per user m must be a positive multiple of 4; got m={m}")
        if "u_star" not in shapes and "x_test" not in shapes:
            raise ValueError("data: without u_star there is nothing to measure; add x_test/y_test (held-out samples)")

    def _open(self, name: str) -> np.ndarray | _StoredRows:
        from fedpers.data.npz_rows import member_memmap

        try:
            mapped = member_memmap(self.path, name)  # only for its offset, shape and dtype: never touched
            stored = _StoredRows(self.path, int(mapped.offset), tuple(mapped.shape), mapped.dtype)
            del mapped
            return stored
        except ValueError as e:  # compressed or Fortran-ordered: inflate this member once
            if "compressed" not in str(e) and "C-ordered" not in str(e):
                raise
        shape, dtype = self._members[name]
        need, limit = math.prod(shape) * (dtype.itemsize + 8), memory.available_bytes()
        if limit > 0 and need > limit:
            raise ValueError(
                f"data: {name} of {self.path.name} is compressed or Fortran-ordered and needs about {memory.human(need)} in memory "
                f"but {memory.human(limit)} is available; save it with np.savez (C order) to have it read in chunks"
            )
        try:
            with np.load(self.path, allow_pickle=False) as f:
                return np.asarray(f[name])
        except Exception as e:
            raise ValueError(f"data: cannot read {name} of {str(self.path)!r} ({e})") from None

    def _check_finite(self, name: str) -> None:
        """Non-finite ``u_star``/``v_star`` (the file's declared truth) refuse the file; in a
        user's samples (x, y, x_test, y_test) they are counted, and :meth:`rows` zeroes them."""
        a = self._arrays[name]
        rows = a.shape[0] if len(a.shape) else 1
        bad = 0
        for start in range(0, rows, self.CHECK_ROWS):
            block = _slice(a, start, min(start + self.CHECK_ROWS, rows)) if len(a.shape) else np.asarray(a)
            finite = np.isfinite(block)
            bad += (
                int((~finite.reshape(*finite.shape[:2], -1).all(-1)).sum()) if name in SAMPLES else int((~finite).sum())
            )
        if bad and name not in SAMPLES:
            raise ValueError(f"data: {name} has {bad} NaN/inf value(s)")
        if bad:
            self.samples_zeroed[name] = bad

    LABEL_SAMPLE = 1 << 20
    """At most about this many of y's labels (evenly strided) fix the robust range's quartiles."""

    def _count_label_outliers(self) -> None:
        """The robust range of y's finite labels, and how many labels of y and y_test lie beyond it
        (two streamed passes over the labels, never the features)."""
        y = self._arrays["y"]
        rows, per_row = self.shapes["y"][0], max(1, math.prod(self.shapes["y"][1:]))
        stride = max(1, rows * per_row // self.LABEL_SAMPLE)
        sample = []
        for start in range(0, rows, self.CHECK_ROWS):
            block = np.asarray(_slice(y, start, min(start + self.CHECK_ROWS, rows)), dtype=np.float64).ravel()
            sample.append(block[np.isfinite(block)][::stride])
        self.label_range = summary.robust_range(np.concatenate(sample) if sample else np.zeros(0))
        lo, hi = self.label_range
        self.labels_beyond = 0
        for name in ("y", "y_test"):
            if name not in self._arrays:
                continue
            a, n = self._arrays[name], self.shapes[name][0]
            for start in range(0, n, self.CHECK_ROWS):
                block = np.asarray(_slice(a, start, min(start + self.CHECK_ROWS, n)), dtype=np.float64)
                self.labels_beyond += int(((block < lo) | (block > hi)).sum())  # NaN compares false: not counted

    def summary(self) -> FileSummary:
        """Descriptive counts of the input file (computed by whoever holds it; not DP releases)."""
        n, m, d = self.shapes["x"]
        return {
            "file": self.path.name,
            "users": n,
            "samples_per_user": m,
            "features": d,
            "samples_zeroed": dict(sorted(self.samples_zeroed.items())),
            "labels_beyond_robust_range": self.labels_beyond,
            "label_robust_range": [float(f"{v:.4g}") for v in self.label_range],
            "note": summary.NOTE,
        }

    def rows(self, ids: Tensor) -> dict[str, Tensor]:
        """float64 tensors of the given users' rows of every per-user array (and ``ids``)."""
        index = ids.to(torch.int64).cpu().numpy()
        if index.size and (index.min() < 0 or index.max() >= self.n):
            raise ValueError(f"data: user ids outside 0..{self.n - 1} of {self.path.name}")
        out = {}
        for name, a in self._arrays.items():
            if name == "u_star":
                continue
            if index.size and np.all(np.diff(index) == 1):  # a contiguous range: one read
                block = _slice(a, int(index[0]), int(index[-1]) + 1)
            else:
                block = np.stack([_slice(a, int(i), int(i) + 1)[0] for i in index]) if index.size else _slice(a, 0, 0)
            out[name] = torch.from_numpy(block).to(torch.float64)
        for x, y in (("x", "y"), ("x_test", "y_test")):
            if x in out and (self.samples_zeroed.get(x) or self.samples_zeroed.get(y)):
                bad = ~(torch.isfinite(out[x]).all(-1) & torch.isfinite(out[y]))  # one user's bad sample: zeroed
                out[x][bad] = 0.0
                out[y][bad] = 0.0
        out["ids"] = ids.to(torch.int64).cpu()
        return out


class _StoredRows:
    """An uncompressed C-ordered ``.npy`` inside the zip, read by byte range (``pread``): the
    rows pass through the page cache, never into this process's memory beyond the copy."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.path, self.offset, self.shape, self.dtype = path, offset, shape, np.dtype(dtype)
        self.row_bytes = int(math.prod(shape[1:])) * self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        view = out.reshape(-1).view(np.uint8).data  # a writable memoryview of out's bytes
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset + start * self.row_bytes)
            done = 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"data: {self.path.name} ends early (truncated file?)")
                done += got
        return out


def _slice(a: np.ndarray | _StoredRows, start: int, stop: int) -> np.ndarray:
    return a.read(start, stop) if isinstance(a, _StoredRows) else np.array(a[start:stop])


def load_altmin_npz(path: str | Path, rank: int) -> dict[str, Tensor]:
    """Every array of a checked file in memory (float64 tensors, ``ids`` added)."""
    f = AltMinFile(path, rank)
    out = f.rows(torch.arange(f.n))
    if f.u_star is not None:
        out["u_star"] = f.u_star
    return out


def _all_stored(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    except (zipfile.BadZipFile, OSError):
        return False


def save_altmin_npz(path: str | Path, **arrays: Tensor | np.ndarray) -> None:
    """Write the schema above (used by tests and by users converting their data)."""
    # allow_pickle is numpy's default, named so that no array name can be taken for it
    np.savez(path, allow_pickle=True, **{k: (v.numpy() if isinstance(v, Tensor) else v) for k, v in arrays.items()})
