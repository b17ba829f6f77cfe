"""A Flower node with a data file reads only its own rows (from the s13 helper branch)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedpers import config as config_lib
from fedpers.data import files
from fedpers.experiments import EXPERIMENTS
from fedpers.runtime.flower import client, codec

EXP = EXPERIMENTS["altmin"]


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    monkeypatch.setattr(client, "_jobs", {})
    monkeypatch.setattr(client, "_units", type(client._units)())


def test_a_node_asked_for_10_of_many_users_reads_only_their_rows(tmp_path: Path, monkeypatch):
    n, m, d, k = 40_000, 8, 6, 2
    rng = np.random.default_rng(0)
    u = np.linalg.qr(rng.standard_normal((d, k)))[0]
    x = np.zeros((n, m, d))
    x[:, :, 0] = np.arange(n)[:, None]  # row i is recognisable
    path = tmp_path / "big.npz"
    np.savez(path, x=x, y=np.ones((n, m)), u_star=u)
    asked: list[tuple[int, int]] = []
    read = files._StoredRows.read
    monkeypatch.setattr(files._StoredRows, "read", lambda self, a, b: (asked.append((a, b)), read(self, a, b))[1])
    cfg = config_lib.build(EXP.config_type, {"rank": k, "rounds": 2, "cohorts": "all", "seed": 3, "epsilon": 2.0, "data": str(path)})
    job = codec.Job.of("altmin", cfg, EXP.protocol(cfg))
    node = client.node_job(job, str(path))
    units = client.node_units(job, str(path), node, 1000, 1010)
    assert units["x"][:, 0, 0].tolist() == list(range(1000, 1010))
    assert (1000, 1010) in asked
    # nothing reads the file whole: the open-time finiteness check goes in bounded row blocks
    assert max(b - a for a, b in asked) <= files.AltMinFile.CHECK_ROWS < n
