"""GPU sharing in the Flower simulation: fractional ``client_gpus`` on declared (logical) GPUs.

CI has no GPU, so the simulation's own Ray declares one logical GPU (``sim_gpus=1``): Ray
does the same resource arithmetic as on a real one (node actors hold 0.1 of it each, at
most 10 at once), while the nodes compute on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fedpers import config as config_lib
from fedpers.app import flower_job, make_client_app, simulate_objects
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Privatizer
from fedpers.runner import RuntimeOptions, split_seed
from fedpers.runtime.flower import client as flower_client
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.simulation import actor_capacity, check_resources, federation_config
from fedpers.runtime.flower.simulation import run_flower as run_on_grid
from fedpers.runtime.local import run_local

EXP = EXPERIMENTS["altmin"]
ROOT = Path(__file__).resolve().parents[1]


def options(**kw) -> RuntimeOptions:
    return config_lib.build(RuntimeOptions, {"runtime": "flower", **kw})


def test_client_gpus_is_a_share_of_one_gpu_or_whole_gpus():
    assert options(client_gpus=0.1).client_gpus == 0.1 and options(client_gpus=2).client_gpus == 2.0
    with pytest.raises(ValueError, match=r"client_gpus must be in \[0, 1\].*whole number.*1.5"):
        options(client_gpus=1.5)
    with pytest.raises(ValueError, match="client_gpus"):
        options(client_gpus=-0.1)
    with pytest.raises(ValueError, match="sim_gpus"):
        options(sim_gpus=-2)


def test_a_share_that_cannot_fit_is_refused_naming_the_fields(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"client_gpus=2.0 does not fit.*1 GPU.*sim_gpus=1"):
        check_resources(options(client_gpus=2, sim_gpus=1))
    with pytest.raises(ValueError, match=r"client_gpus=0.5 but the simulation's Ray has no GPU.*--sim-gpus"):
        check_resources(options(client_gpus=0.5, sim_gpus=0))
    with pytest.raises(ValueError, match=r"sim_gpus=1 declares.*ray_address='127.0.0.1:1'"):
        check_resources(options(sim_gpus=1, ray_address="127.0.0.1:1"))
    with pytest.raises(ValueError, match=r"device=cuda on the Flower simulation needs client_gpus > 0"):
        check_resources(options(sim_gpus=1), "cuda")
    with pytest.raises(ValueError, match=r"device=cuda:1.*use device cuda"):
        check_resources(options(sim_gpus=1, client_gpus=0.5), "cuda:1")
    check_resources(options(client_gpus=0.1, sim_gpus=1), "cuda")  # fits: no error
    check_resources(options(client_gpus=2, sim_gpus=2))


def test_the_declared_gpus_reach_ray_and_cap_the_actor_pool(monkeypatch):
    """The simulation settings fedpers hands `flwr run --federation-config` become, as Flower's simulation
    reads them, Ray's init arguments and each actor's resources; Flower sizes its pool from Ray's
    resources: 0.1 GPU per actor on one declared GPU → 10 actors although 20 CPUs would allow 20."""
    import ray
    from flwr.common.config import parse_config_args
    from flwr.simulation.app import _run_simulation_settings
    from flwr.simulation.ray_transport.ray_actor import pool_size_from_resources
    from flwr.supercore.utils import simulation_config_from_json

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    opts = options(nodes=12, client_gpus=0.1, client_cpus=1.0, sim_gpus=1)
    pairs = " ".join(f"{k}={json.dumps(v)}" for k, v in federation_config(opts).items())  # as the flwr CLI gets them
    parsed = {k.replace("-", "_"): v for k, v in parse_config_args([pairs]).items()}
    nodes, backend, cfg, _, _ = _run_simulation_settings(simulation_config_from_json(parsed))
    assert (nodes, backend) == (12, "ray")
    assert cfg["init_args"]["num_gpus"] == 1 and cfg["client_resources"] == {
        "num_cpus": 1,
        "num_gpus": pytest.approx(0.1),
    }
    assert cfg["client_resources"]["num_gpus"] <= 0.1  # a 32-bit float just above 0.1 would leave room for 9 actors
    assert "init-args-num-gpus" not in federation_config(
        options(ray_address="127.0.0.1:1")
    )  # a cluster declares its own
    assert not ray.is_initialized()
    ray.init(num_gpus=cfg["init_args"]["num_gpus"], num_cpus=20, include_dashboard=False, logging_level="error")
    try:
        assert ray.cluster_resources()["GPU"] == 1.0
        assert pool_size_from_resources(cfg["client_resources"]) == 10 == actor_capacity(1.0, 0.1, 20, 1)
    finally:
        ray.shutdown()
    assert actor_capacity(1.0, 0.1, 2, 1) == 2  # CPUs bind first on a 2-core machine
    assert actor_capacity(1.0, 0.1, 2, 0) == 0


def test_a_node_keeps_its_users_on_the_runs_device():
    """The job's device decides where a node's users live between rounds (``meta`` stands in for a GPU)."""
    cfg = config_lib.build(EXP.config_type, {"n_users": 12, "dim": 4, "rank": 2, "samples_per_user": 8, "rounds": 1})
    protocol = EXP.protocol(cfg)
    job = codec.Job.of("altmin", cfg, protocol)
    values = json.loads(job.config_json)
    values["device"] = "meta"
    job = dataclasses.replace(job, config_json=json.dumps(values, sort_keys=True))
    node = flower_client.Node(protocol, lambda ids: EXP.units(cfg, ids))  # loads on the CPU
    found = flower_client.node_job(job, "", lambda j, f: node)
    units = flower_client.node_units(job, "", found, 0, 6)
    assert {v.device.type for v in units.values()} == {"meta"}
    assert flower_client.run_device(codec.Job.of("altmin", cfg, protocol)) == torch.device("cpu")


@pytest.mark.slow  # a Flower simulation: ~30 s on 2 cores
def test_fractional_gpu_simulation_equals_the_local_runtime(monkeypatch):
    """--client-gpus 0.1 on one declared GPU: node actors hold 0.1 GPU each, and U equals the local runtime's."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg, noise_seed = split_seed(
        config_lib.build(
            EXP.config_type, {"n_users": 60, "dim": 4, "rank": 2, "samples_per_user": 8, "rounds": 2, "seed": 3}
        )
    )
    privatizer = Privatizer(noise_seed)
    expected, _ = run_local(EXP.protocol(cfg), EXP.units(cfg, torch.arange(60)), privatizer, progress=False)
    protocol = EXP.protocol(cfg)
    job = flower_job(EXP, cfg, protocol)
    opts = options(nodes=3, client_cpus=1.0, client_gpus=0.1, sim_gpus=1)
    privatizer = Privatizer(noise_seed)

    def server(grid, context):  # runs in Flower's simulation process, beside the simulation's Ray
        seen: list[tuple[float, float, float]] = []

        def on_round(record, state) -> None:
            total, free = ray.cluster_resources(), ray.available_resources()
            seen.append((total.get("GPU", 0.0), total.get("GPU", 0.0) - free.get("GPU", 0.0), total.get("CPU", 0.0)))

        state, records = run_on_grid(job, 60, protocol, privatizer, opts, grid=grid, progress=False, on_round=on_round)
        return state, records, seen

    state, records, seen = simulate_objects(server, make_client_app(), opts, extra={"tests": ROOT / "tests"})
    torch.testing.assert_close(state["U"], expected["U"], rtol=0, atol=1e-6)
    assert [r.accepted for r in records] == [3, 3, 3]
    assert seen, "on_round never ran"
    for gpus, used, cpus in seen:
        actors = actor_capacity(1.0, 0.1, cpus, gpus)
        assert gpus == 1.0 and 1 <= actors <= 10
        assert used == pytest.approx(0.1 * actors, abs=1e-3)  # each actor holds its 0.1 share (Ray keeps 4 decimals)
