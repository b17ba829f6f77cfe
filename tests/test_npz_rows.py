"""A node reads only its rows of an .npz: same values as a full load, far less memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedpers.data.npz_rows import read_rows

ROOT = Path(__file__).resolve().parents[1]


def test_rows_equal_full_load(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((50, 8, 3)), rng.standard_normal((50, 8)).astype(np.float32)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y, u_star=np.eye(3)[:, :2])
    np.testing.assert_array_equal(read_rows(path, "x", 7, 19), x[7:19])
    np.testing.assert_array_equal(read_rows(path, "y", 0, 50), y)
    assert read_rows(path, "y", 49, 50).dtype == np.float32
    assert read_rows(path, "x", 5, 5).shape == (0, 8, 3)


def test_refusals_name_the_problem(tmp_path):
    path = tmp_path / "c.npz"
    np.savez_compressed(path, x=np.zeros((4, 2)))
    with pytest.raises(ValueError, match="compressed"):
        read_rows(path, "x", 0, 1)
    np.savez(path, x=np.zeros((4, 2)))
    with pytest.raises(ValueError, match="no array 'y'"):
        read_rows(path, "y", 0, 1)
    with pytest.raises(ValueError, match="outside the 4 rows"):
        read_rows(path, "x", 2, 5)


PEAK = """
import sys, numpy as np
from fedpers.data.npz_rows import read_rows
path, mode = sys.argv[1], sys.argv[2]
if mode == "rows":
    a = read_rows(path, "x", 100, 110)
else:
    with np.load(path) as f:
        a = f["x"][100:110].copy()
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")))  # this image's peak, kB
"""


def test_ten_rows_cost_far_less_memory_than_the_file(tmp_path):
    path = tmp_path / "big.npz"
    np.savez(path, x=np.ones((20000, 40, 50)))  # 320 MB member
    peak = {}
    for mode in ("rows", "full"):
        done = subprocess.run(
            [sys.executable, "-c", PEAK, str(path), mode],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            env={"PYTHONPATH": str(ROOT), "PATH": ""},
        )
        assert done.returncode == 0, done.stderr
        peak[mode] = int(done.stdout.split()[-1]) * 1024
    assert peak["full"] - peak["rows"] > 250e6, peak


def test_a_users_non_finite_sample_is_zeroed_and_counted_not_refused(tmp_path):
    """One user's NaN/inf used to refuse the whole .npz (its neighbour ran)."""
    import torch

    from fedpers.data.files import AltMinFile

    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((6, 8, 3)), rng.standard_normal((6, 8))
    xt, yt = rng.standard_normal((6, 2, 3)), rng.standard_normal((6, 2))
    clean = tmp_path / "c.npz"
    np.savez(clean, x=x, y=y, x_test=xt, y_test=yt)
    x[2, 5, 1], y[4, 0], xt[1, 1, 0] = np.nan, np.inf, -np.inf
    bad = tmp_path / "b.npz"
    np.savez(bad, x=x, y=y, x_test=xt, y_test=yt)
    f, g = AltMinFile(bad, 2), AltMinFile(clean, 2)
    assert f.summary()["samples_zeroed"] == {"x": 1, "x_test": 1, "y": 1}
    rows, ref = f.rows(torch.arange(6)), g.rows(torch.arange(6))
    assert all(torch.isfinite(rows[k]).all() for k in ("x", "y", "x_test", "y_test"))
    assert float(rows["x"][2, 5].abs().sum() + rows["y"][2, 5].abs()) == 0.0 and float(rows["y"][4, 0]) == 0.0
    keep = torch.ones(6, 8, dtype=torch.bool)
    keep[2, 5] = keep[4, 0] = False
    assert torch.equal(rows["x"][keep], ref["x"][keep]) and rows["x"].shape == ref["x"].shape
    np.savez(bad, x=x, y=y, x_test=xt, y_test=yt, u_star=np.full((3, 2), np.nan))
    with pytest.raises(ValueError, match="u_star has 6 NaN/inf"):
        AltMinFile(bad, 2)


def test_an_npz_label_of_1e9_is_counted_beyond_the_robust_range(tmp_path):
    """The .npz input counts outlying labels as the long format does (y and y_test, finite ones)."""
    from fedpers.data.files import AltMinFile

    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((50, 8, 3)), rng.standard_normal((50, 8))
    xt, yt = rng.standard_normal((50, 2, 3)), rng.standard_normal((50, 2))
    np.savez(tmp_path / "c.npz", x=x, y=y, x_test=xt, y_test=yt)
    assert AltMinFile(tmp_path / "c.npz", 2).summary()["labels_beyond_robust_range"] == 0
    y[3, 1], yt[7, 0], y[9, 2] = 1e9, -1e9, np.nan
    np.savez(tmp_path / "o.npz", x=x, y=y, x_test=xt, y_test=yt)
    s = AltMinFile(tmp_path / "o.npz", 2).summary()
    assert (
        s["labels_beyond_robust_range"] == 2
        and -20 < s["label_robust_range"][0] < -3 < 3 < s["label_robust_range"][1] < 20
    )
