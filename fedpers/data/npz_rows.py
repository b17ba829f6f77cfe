"""Rows of an uncompressed ``.npz`` member without reading the rest of the file.

``np.load`` on an ``.npz`` inflates a whole member; a Flower node holding 10 of 400,000
users only needs its own rows. ``np.savez`` stores members uncompressed, so each member is
a ``.npy`` at a fixed offset inside the zip: we read its header and memory-map just that
member, then copy out the requested rows (pages of other rows are never touched).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

_LOCAL_HEADER = 30
"""Bytes of a zip local file header before its file name and extra field."""


def member_memmap(path: str | Path, name: str) -> np.memmap:
    """Read-only memory map of member ``name`` (``"x"`` for ``x.npy``) of an uncompressed ``.npz``.

    Raises ValueError naming the file and member when the member is missing, compressed or not a
    plain numeric ``.npy``.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            info = z.getinfo(f"{name}.npy")
    except KeyError:
        raise ValueError(f"data: {path.name} has no array {name!r}") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"data: cannot read {str(path)!r} as .npz ({e})") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(
            f"data: {name} in {path.name} is compressed; save with np.savez (not savez_compressed) to read rows"
        )
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(_LOCAL_HEADER)
        if len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
            raise ValueError(f"data: {path.name}: bad zip header for {name}")
        name_len = int.from_bytes(local[26:28], "little")
        extra_len = int.from_bytes(local[28:30], "little")
        f.seek(info.header_offset + _LOCAL_HEADER + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        if dtype.hasobject or fortran:
            raise ValueError(f"data: {name} in {path.name} must be a C-ordered numeric array")
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape), order="C")


def read_rows(path: str | Path, name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start..stop-1`` of member ``name``, copied out of a memory map (an in-memory array)."""
    mapped = member_memmap(path, name)
    n = mapped.shape[0] if mapped.ndim else 0
    if not 0 <= start <= stop <= n:
        raise ValueError(f"data: rows {start}..{stop} outside the {n} rows of {name} in {Path(path).name}")
    rows = np.array(mapped[start:stop])
    del mapped
    return rows
