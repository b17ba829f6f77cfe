"""Per-user data from a file: one ``.npz`` schema, checked before any work.

Arrays (n users, m samples each, d features):

- ``x``       float (n, m, d)   required; m divisible by 4
- ``y``       float (n, m)      required
- ``u_star``  float (d, k)      optional true subspace (enables subspace metrics)
- ``v_star``  float (n, k)      optional true personal vectors (with ``u_star``: excess risk)
- ``x_test``  float (n, t, d)   optional held-out samples per user (test MSE)
- ``y_test``  float (n, t)      required with ``x_test``
"""
from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np
import torch
from numpy.lib import format as npy_format

from fedpers import memory

Tensor = torch.Tensor
REQUIRED = ("x", "y")
ORTHONORMAL_TOLERANCE = 1e-6
OPTIONAL = ("u_star", "v_star", "x_test", "y_test")


def inspect_npz(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each member's name, shape and dtype from the zip directory and the .npy headers: nothing
    is inflated, so a small file with a huge or unexpected member is refused at no cost."""
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
            except Exception as e:  # noqa: BLE001 - any unreadable header is the same user error
                raise ValueError(f"data: {name} in {path.name} is not a readable .npy array ({e})") from None
            if dtype.kind == "c":
                raise ValueError(f"data: {name} is complex-valued ({dtype}); only real numbers are allowed")
            if dtype.kind not in "biuf":
                raise ValueError(f"data: {name} must be numeric; got dtype {dtype}")
            members[name] = (tuple(shape), dtype)
    need = sum(math.prod(shape) * (dtype.itemsize + 8) for shape, dtype in members.values())
    limit = memory.available_bytes()
    if limit > 0 and need > limit:
        raise ValueError(f"data: loading {path.name} needs about {memory.human(need)} but {memory.human(limit)} is available")
    return members


def load_altmin_npz(path: str | Path, rank: int) -> dict[str, Tensor]:
    """Load and validate the schema above; every problem is reported with the array name and shape.

    Names, dtypes and sizes are checked from the headers before anything is inflated.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: no such file {str(path)!r}")
    inspect_npz(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: np.asarray(f[k]) for k in f.files}
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"data: cannot read {str(path)!r} as .npz ({e})") from None
    missing = [k for k in REQUIRED if k not in arrays]
    if missing:
        raise ValueError(f"data: {path.name} lacks required array(s) {missing}; schema: x (n,m,d), y (n,m)")
    x, y = arrays["x"], arrays["y"]
    if x.ndim != 3:
        raise ValueError(f"data: x must have shape (n, m, d); got {x.shape}")
    n, m, d = x.shape
    expected = {"y": (n, m), "u_star": (d, rank), "v_star": (n, rank)}
    if "x_test" in arrays:
        if arrays["x_test"].ndim != 3 or arrays["x_test"].shape[0] != n or arrays["x_test"].shape[2] != d:
            raise ValueError(f"data: x_test must have shape ({n}, t, {d}); got {arrays['x_test'].shape}")
        if arrays["x_test"].shape[1] < 1:
            raise ValueError(f"data: x_test must hold t >= 1 samples per user; got shape {arrays['x_test'].shape}")
        expected["y_test"] = arrays["x_test"].shape[:2]
    elif "y_test" in arrays:
        raise ValueError("data: y_test given without x_test")
    for name, shape in expected.items():
        if name in arrays and arrays[name].shape != tuple(shape):
            raise ValueError(f"data: {name} must have shape {tuple(shape)}; got {arrays[name].shape}")
    if "v_star" in arrays and "u_star" not in arrays:
        raise ValueError("data: v_star given without u_star")
    for name, a in arrays.items():
        if not np.issubdtype(a.dtype, np.number):
            raise ValueError(f"data: {name} must be numeric; got dtype {a.dtype}")
        if not np.isfinite(a).all():
            raise ValueError(f"data: {name} has {int((~np.isfinite(a)).sum())} NaN/inf value(s)")
    if m % 4 != 0 or m < 4:
        raise ValueError(f"data: samples per user m must be a positive multiple of 4; got m={m}")
    if "u_star" in arrays:
        u = arrays["u_star"].astype(np.float64)
        gap = float(np.abs(u.T @ u - np.eye(u.shape[1])).max())
        if gap > ORTHONORMAL_TOLERANCE:
            raise ValueError(f"data: u_star must have orthonormal columns (max |UᵀU − I| = {gap:.3g} > {ORTHONORMAL_TOLERANCE:g})")
    if "u_star" not in arrays and "x_test" not in arrays:
        raise ValueError("data: without u_star there is nothing to measure; add x_test/y_test (held-out samples)")
    out = {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.float64) for k, v in arrays.items()}
    out["ids"] = torch.arange(n)
    return out


def save_altmin_npz(path: str | Path, **arrays: Tensor | np.ndarray) -> None:
    """Write the schema above (used by tests and by users converting their data)."""
    np.savez(path, **{k: (v.numpy() if isinstance(v, Tensor) else v) for k, v in arrays.items()})
