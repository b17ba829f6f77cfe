"""A Flower node with a data file reads only its own rows (from the s13 helper branch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedpers import config as config_lib
from fedpers.app import build_node
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
    cfg = config_lib.build(
        EXP.config_type, {"rank": k, "rounds": 2, "cohorts": "all", "seed": 3, "epsilon": 2.0, "data": str(path)}
    )
    job = codec.Job.of("altmin", cfg, EXP.protocol(cfg))
    node = client.node_job(job, str(path), build_node)
    units = client.node_units(job, str(path), node, 1000, 1010)
    assert units["x"][:, 0, 0].tolist() == list(range(1000, 1010))
    assert (1000, 1010) in asked
    # nothing reads the file whole: the open-time finiteness check goes in bounded row blocks
    assert max(b - a for a, b in asked) <= files.AltMinFile.CHECK_ROWS < n


def test_node_cache_loads_units_once_across_processes_and_notices_a_changed_file(tmp_path: Path, monkeypatch):
    """With $FEDPERS_NODE_CACHE a new ClientApp process (here: cleared in-memory caches) reuses
    the units an earlier one loaded; a data file rewritten since is read again."""
    import os

    import torch

    n, m, d, k = 200, 8, 5, 2
    rng = np.random.default_rng(1)
    path = tmp_path / "users.npz"
    np.savez(
        path,
        x=rng.standard_normal((n, m, d)),
        y=rng.standard_normal((n, m)),
        u_star=np.linalg.qr(rng.standard_normal((d, k)))[0],
    )
    monkeypatch.setenv(client.NODE_CACHE_ENV, str(tmp_path / "cache"))
    calls = []
    original = type(EXP).units
    monkeypatch.setattr(type(EXP), "units", lambda self, cfg, ids: (calls.append(1), original(self, cfg, ids))[1])
    cfg = config_lib.build(EXP.config_type, {"rank": k, "rounds": 1, "seed": 3, "data": str(path)})
    job = codec.Job.of("altmin", cfg, EXP.protocol(cfg))
    first = client.node_units(job, str(path), client.node_job(job, str(path), build_node), 50, 120)
    for _ in range(2):  # two "new processes"
        client._units.clear()
        again = client.node_units(job, str(path), client.node_job(job, str(path), build_node), 50, 120)
        for key in first:
            assert torch.equal(first[key], again[key])
    assert len(calls) == 1
    np.savez(
        path,
        x=rng.standard_normal((n, m, d)),
        y=rng.standard_normal((n, m)),
        u_star=np.linalg.qr(rng.standard_normal((d, k)))[0],
    )
    os.utime(path, ns=(1, 1))
    client._units.clear()
    changed = client.node_units(job, str(path), client.node_job(job, str(path), build_node), 50, 120)
    assert len(calls) == 2 and not torch.equal(changed["x"], first["x"])


def test_a_node_cache_that_cannot_be_written_costs_speed_not_the_round(tmp_path: Path, monkeypatch, caplog):
    """$FEDPERS_NODE_CACHE under a plain file (no directory can be made there): the units load as
    without a cache, a warning names the variable, nothing half-written is left."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(client.NODE_CACHE_ENV, str(blocker / "cache"))
    cfg = config_lib.build(
        EXP.config_type, {"n_users": 40, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 1, "seed": 3}
    )
    job = codec.Job.of("altmin", cfg, EXP.protocol(cfg))
    client._units.clear()
    with caplog.at_level("WARNING", logger="fedpers.flower"):
        units = client.node_units(job, "", client.node_job(job, "", build_node), 10, 30)
    client._units.clear()
    assert units["ids"].tolist() == list(range(10, 30))
    assert client.NODE_CACHE_ENV in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["not-a-dir"]


@pytest.mark.parametrize("algorithm", ["altmin", "fedrep"])
def test_small_ranges_of_generated_users_are_read_out_of_one_shared_block(algorithm):
    """A process serving many one-user nodes generates their users once per block of
    SHARED_BLOCK, and each node's rows equal those generated for its range alone; a node with a
    data file loads its own range only."""
    import torch

    from fedpers.app import flower_job
    from fedpers.privacy.accountant import Calibrations

    exp, calibrations = EXPERIMENTS[algorithm], Calibrations()
    cfg = config_lib.build(exp.config_type, {"n_users": 300, "dim": 6, "rank": 2, "epsilon": 4.0})
    job = flower_job(exp, cfg, exp.protocol(cfg, calibrations), calibrations.table)
    node = client.node_job(job, "", build_node)
    total = node.node.num_units
    assert total > client.SHARED_BLOCK
    loads: list[tuple[int, int]] = []
    own = node.node.units

    def counted(ids: torch.Tensor):
        loads.append((int(ids[0]), int(ids[-1]) + 1))
        return own(ids)

    object.__setattr__(node.node, "units", counted)
    for start in (3, 4, 200, client.SHARED_BLOCK + 1):
        got = client.node_units(job, "", node, start, start + 1)
        alone = own(torch.arange(start, start + 1))
        assert set(got) == set(alone) and all(torch.equal(got[k], alone[k]) for k in alone)
    assert loads == [(0, client.SHARED_BLOCK), (client.SHARED_BLOCK, min(2 * client.SHARED_BLOCK, total))]
    assert client._load_range(job, "node.npz", node, 3, 4) == (3, 4)
    assert client._load_range(job, "", node, 0, client.SHARED_BLOCK) == (0, client.SHARED_BLOCK)
