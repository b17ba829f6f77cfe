"""The Flower runtime in Flower's simulation engine on Ray, attached to a Ray head started here.

One Ray head serves the module (``--ray-address``), so each simulation pays only for its
client actors, not for a new Ray cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpers import config as config_lib
from fedpers.app import run_flower
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Privatizer
from fedpers.runner import RuntimeOptions, execute, split_seed
from fedpers.runtime.flower.partition import unit_ranges
from fedpers.runtime.local import run_local
from tests.flower_support import faulty_client_app, free_port, start_ray, stop_processes, wait_for_ray_nodes

ROOT = Path(__file__).resolve().parents[1]
EXP = EXPERIMENTS["altmin"]


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """A Ray head on 127.0.0.1 with free ports; stopped (with all its processes) at the end."""
    temp = Path("/tmp") / f"fedpers-ray-{os.getpid()}"
    port = free_port()
    proc = start_ray(tmp_path_factory.mktemp("ray") / "head.log", temp, head_port=port)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_processes([proc])
        shutil.rmtree(temp, ignore_errors=True)


def options(ray_address: str, **kw) -> RuntimeOptions:
    return config_lib.build(RuntimeOptions, {"runtime": "flower", "ray_address": ray_address, "client_cpus": 1.0, **kw})


def local_state(cfg, noise_seed, keep=None):
    protocol = EXP.protocol(cfg)
    units = EXP.units(cfg, torch.arange(EXP.num_units(cfg)))
    if keep is not None:
        units = {k: v[keep] for k, v in units.items()}
    privatizer = Privatizer(noise_seed)
    state, _ = run_local(protocol, units, privatizer, progress=False)
    return state, privatizer.ledger


SMALL = {"n_users": 240, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 2, "seed": 5}


@pytest.mark.slow  # > 10 s; in CI's slow run
def test_flower_runtime_equals_local_with_many_users_per_node(ray_address, tmp_path):
    """execute(--runtime flower --nodes 4): same U (float64), ledger and run directory as --runtime local."""
    cfg = config_lib.build(EXP.config_type, SMALL)
    local = execute(EXP, cfg, out=tmp_path / "local", progress=False)
    result = execute(EXP, cfg, options(ray_address, nodes=4), out=tmp_path / "flower", progress=False)
    U = torch.from_numpy(np.load(tmp_path / "flower" / "final_state.npz")["U"])
    torch.testing.assert_close(U, local["_state"]["U"], rtol=0, atol=1e-5)
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    rounds = [json.loads(line) for line in (tmp_path / "flower" / "rounds.jsonl").read_text().splitlines()]
    assert [(r["clients"], r["clients_accepted"], r["dropped"]) for r in rounds] == [(4, 4, {})] * 3
    assert result["runtime"] == "flower" and result["epsilon"] == local["epsilon"]
    assert abs(result["subspace_error"] - local["subspace_error"]) < 1e-8


@pytest.mark.slow
def test_cli_json_on_the_flower_runtime(ray_address, tmp_path):
    """`fedpers run altmin --runtime flower ... --json`: one JSON object on stdout, the run directory on disk."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "fedpers",
        "run",
        "altmin",
        *args,
        "--runtime",
        "flower",
        "--nodes",
        "3",
        "--ray-address",
        ray_address,
        "--client-cpus",
        "1",
        "--json",
        "--out",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    local = execute(EXP, config_lib.build(EXP.config_type, SMALL), write=False, progress=False)
    assert result["runtime"] == "flower" and result["run_dir"] == str(tmp_path / "run")
    U = torch.from_numpy(np.load(tmp_path / "run" / "final_state.npz")["U"])
    torch.testing.assert_close(U, local["_state"]["U"], rtol=0, atol=1e-5)


@pytest.mark.slow  # > 10 s; in CI's slow run
def test_one_user_per_node_equals_local(ray_address):
    cfg, noise_seed = split_seed(
        config_lib.build(
            EXP.config_type, {"n_users": 10, "dim": 4, "rank": 2, "samples_per_user": 8, "rounds": 2, "seed": 2}
        )
    )
    expected, ledger = local_state(cfg, noise_seed)
    privatizer = Privatizer(noise_seed)
    state, records = run_flower(
        EXP, cfg, EXP.protocol(cfg), privatizer, options(ray_address, nodes=10, users_per_node=1), progress=False
    )
    torch.testing.assert_close(state["U"], expected["U"], rtol=0, atol=1e-5)
    assert privatizer.ledger == ledger
    assert [r.accepted for r in records] == [10, 10, 10] and [r.units for r in records] == [10, 5, 5]


@pytest.mark.slow
def test_faulty_ray_clients_are_dropped_and_the_run_completes(ray_address):
    """The in-process Grid test covers every fault in the default suite; this one goes through Ray's error path."""
    cfg, noise_seed = split_seed(
        config_lib.build(
            EXP.config_type, {"n_users": 120, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 1, "seed": 4}
        )
    )
    faults = {1: "raise", 2: "nan", 3: "huge", 4: "overclaim"}
    privatizer = Privatizer(noise_seed)
    app = faulty_client_app(faults)
    state, records = run_flower(
        EXP,
        cfg,
        EXP.protocol(cfg),
        privatizer,
        options(ray_address, nodes=6, min_fraction=0.3),
        progress=False,
        client_app=app,
        extra={"tests": ROOT / "tests"},
    )
    reasons = {
        "partition-1": "client error",
        "partition-2": "non-finite",
        "partition-3": "norm",
        "partition-4": "unit count",
    }
    for record in records:
        assert record.accepted == 2 and set(record.dropped) == set(reasons)
        assert all(why in record.dropped[c] for c, why in reasons.items()), record.dropped
    ranges = unit_ranges(120, 6)
    honest = torch.cat([torch.arange(ranges[p].start, ranges[p].stop) for p in (0, 5)])
    expected, clean_ledger = local_state(cfg, noise_seed)
    assert privatizer.ledger == clean_ledger
    honest_state, _ = local_state(cfg, noise_seed, keep=honest)
    torch.testing.assert_close(state["U"], honest_state["U"], rtol=0, atol=1e-8)


@pytest.mark.slow
def test_a_two_process_ray_cluster_gives_the_local_result(tmp_path):
    """`ray start --head` plus a second `ray start --address` worker process (1 CPU each): two
    client actors of one CPU need both Ray nodes; the result equals the local runtime's."""
    temp = Path("/tmp") / f"fedpers-ray2-{os.getpid()}"
    port = free_port()
    head = start_ray(tmp_path / "head.log", temp, head_port=port, cpus=1)
    procs = [head]
    try:
        procs.append(start_ray(tmp_path / "worker.log", temp, join=f"127.0.0.1:{port}", cpus=1))
        wait_for_ray_nodes(f"127.0.0.1:{port}", 2)
        cfg, noise_seed = split_seed(
            config_lib.build(EXP.config_type, dict(n_users=400, dim=5, rank=2, samples_per_user=8, rounds=2, seed=4))
        )
        protocol = EXP.protocol(cfg)
        privatizer = Privatizer(noise_seed)
        state, records = run_flower(
            EXP, cfg, protocol, privatizer, options(f"127.0.0.1:{port}", nodes=2), progress=False
        )
        local, ledger = local_state(cfg, noise_seed)
        torch.testing.assert_close(state["U"], local["U"], rtol=0, atol=1e-10)
        assert privatizer.ledger == ledger and all(r.accepted == 2 for r in records)
    finally:
        stop_processes(list(reversed(procs)))
        shutil.rmtree(temp, ignore_errors=True)
