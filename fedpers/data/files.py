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

from pathlib import Path

import numpy as np
import torch

Tensor = torch.Tensor
REQUIRED = ("x", "y")
OPTIONAL = ("u_star", "v_star", "x_test", "y_test")


def load_altmin_npz(path: str | Path, rank: int) -> dict[str, Tensor]:
    """Load and validate the schema above; every problem is reported with the array name and shape."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: no such file {str(path)!r}")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: np.asarray(f[k]) for k in f.files}
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"data: cannot read {str(path)!r} as .npz ({e})") from None
    missing = [k for k in REQUIRED if k not in arrays]
    if missing:
        raise ValueError(f"data: {path.name} lacks required array(s) {missing}; schema: x (n,m,d), y (n,m)")
    extra = sorted(set(arrays) - set(REQUIRED) - set(OPTIONAL))
    if extra:
        raise ValueError(f"data: unknown array(s) {extra}; allowed: {list(REQUIRED + OPTIONAL)}")
    x, y = arrays["x"], arrays["y"]
    if x.ndim != 3:
        raise ValueError(f"data: x must have shape (n, m, d); got {x.shape}")
    n, m, d = x.shape
    expected = {"y": (n, m), "u_star": (d, rank), "v_star": (n, rank)}
    if "x_test" in arrays:
        if arrays["x_test"].ndim != 3 or arrays["x_test"].shape[0] != n or arrays["x_test"].shape[2] != d:
            raise ValueError(f"data: x_test must have shape ({n}, t, {d}); got {arrays['x_test'].shape}")
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
    if "u_star" not in arrays and "x_test" not in arrays:
        raise ValueError("data: without u_star there is nothing to measure; add x_test/y_test (held-out samples)")
    out = {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.float64) for k, v in arrays.items()}
    out["ids"] = torch.arange(n)
    return out


def save_altmin_npz(path: str | Path, **arrays: Tensor | np.ndarray) -> None:
    """Write the schema above (used by tests and by users converting their data)."""
    np.savez(path, **{k: (v.numpy() if isinstance(v, Tensor) else v) for k, v in arrays.items()})
