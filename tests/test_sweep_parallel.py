"""Sweeps on Ray: the same table as one point at a time; every point a run directory; Parquet beside CSV."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from fedpers.sweeps.run import run_sweep

SPEC = """
algorithm = "altmin"
x = "n_users"
series = "epsilon"
metrics = ["subspace_error", "excess_risk"]
repetitions = 2
[base]
dim = 5
rank = 2
baselines = "none"
[grid]
n_users = [300, 600]
epsilon = [1.0, 4.0]
"""


def _table(out: Path) -> list[dict[str, str]]:
    with open(out / "table.csv") as f:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def _close(a: list[dict[str, str]], b: list[dict[str, str]]) -> bool:
    """Equal rows; numbers to 1e-9 relative (a worker's BLAS thread count may move the last bits)."""
    if len(a) != len(b):
        return False
    for ra, rb in zip(a, b):
        for k in ra.keys() | rb.keys():
            x, y = ra.get(k), rb.get(k)
            try:
                if abs(float(x) - float(y)) > 1e-9 * max(1.0, abs(float(y))):
                    return False
            except (TypeError, ValueError):
                if x != y:
                    return False
    return True


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("serial")
    (base / "s.toml").write_text(SPEC)
    run_sweep(base / "s.toml", out=base / "out", progress=False)
    return base / "out"


@pytest.mark.slow  # > 10 s with its fixture; in CI's slow run
def test_points_are_run_directories_and_the_table_is_parquet_too(serial: Path) -> None:
    import pyarrow.parquet as pq

    runs = sorted(p.name for p in (serial / "points").iterdir() if p.is_dir())
    assert runs == [f"{i:05d}-r{r}" for i in range(4) for r in range(2)]
    for name in runs:
        run = serial / "points" / name
        assert {"config.json", "ledger.jsonl", "ledger.json", "result.json", "provenance.json", "final_state.npz"} <= {
            p.name for p in run.iterdir()
        }
    first = json.loads((serial / "points" / "00000-r1" / "config.json").read_text())
    assert first["n_users"] == 300 and first["epsilon"] == 1.0 and first["seed"] == 1  # repetition r has seed + r
    table = pq.read_table(serial / "table.parquet").to_pylist()
    rows = _table(serial)
    assert len(table) == len(rows) == 8
    assert [t["subspace_error"] for t in table] == [float(r["subspace_error"]) for r in rows]
    result = json.loads((serial / "points" / "00003-r1" / "result.json").read_text())
    assert float(rows[-1]["subspace_error"]) == result["subspace_error"]


@pytest.mark.slow  # > 10 s; in CI's slow run
def test_two_workers_on_ray_give_the_serial_table_and_resume_alike(serial: Path, tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text(SPEC)
    summary = run_sweep(tmp_path / "s.toml", out=tmp_path / "par", progress=False, workers=2)
    assert summary["points_run"] == 4 and _close(_table(tmp_path / "par"), _table(serial))
    # a killed parallel sweep: two points' records lost; the resumed one reruns exactly those
    for index in (1, 3):
        (tmp_path / "par" / "points" / f"{index:05d}.json").unlink()
        shutil.rmtree(tmp_path / "par" / "points" / f"{index:05d}-r0")
    summary = run_sweep(tmp_path / "s.toml", out=tmp_path / "par", progress=False, workers=2)
    assert (summary["points_run"], summary["points_reused"]) == (2, 2)
    assert _close(_table(tmp_path / "par"), _table(serial))
    assert (tmp_path / "par" / "points" / "00001-r0" / "result.json").exists()


def test_bad_worker_count_is_refused_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text(SPEC)
    with pytest.raises(ValueError, match="workers must be an integer >= 1; got 0"):
        run_sweep(tmp_path / "s.toml", out=tmp_path / "out", workers=0, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_sweep_on_a_two_process_ray_cluster_gives_the_serial_table(serial: Path, tmp_path: Path) -> None:
    """`ray start --head` plus a second `ray start --address` worker process; the sweep attaches
    with --ray-address and spreads its points over both."""
    from tests.flower_support import free_port, start_ray, stop_processes, wait_for_ray_nodes

    temp = Path("/tmp") / f"fedpers-sweep-ray-{os.getpid()}"
    port = free_port()
    procs = [start_ray(tmp_path / "head.log", temp, head_port=port, cpus=1)]
    try:
        procs.append(start_ray(tmp_path / "worker.log", temp, join=f"127.0.0.1:{port}", cpus=1))
        wait_for_ray_nodes(f"127.0.0.1:{port}", 2)
        (tmp_path / "s.toml").write_text(SPEC)
        summary = run_sweep(
            tmp_path / "s.toml", out=tmp_path / "cluster", progress=False, workers=2, ray_address=f"127.0.0.1:{port}"
        )
        assert summary["points_run"] == 4 and _close(_table(tmp_path / "cluster"), _table(serial))
        assert json.loads((tmp_path / "cluster" / "provenance.json").read_text())["ray_address"] == f"127.0.0.1:{port}"
    finally:
        stop_processes(list(reversed(procs)))
        shutil.rmtree(temp, ignore_errors=True)


def test_a_second_sweep_into_a_directory_in_use_is_refused(tmp_path: Path) -> None:
    from fedpers.results.rundir import lock_directory

    (tmp_path / "s.toml").write_text(SPEC)
    (tmp_path / "out").mkdir()
    holder = lock_directory(tmp_path / "out")  # as a running sweep holds it
    try:
        with pytest.raises(ValueError, match="in use by another running process"):
            run_sweep(tmp_path / "s.toml", out=tmp_path / "out", progress=False)
    finally:
        holder.close()
