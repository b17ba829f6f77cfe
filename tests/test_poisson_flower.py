"""Poisson cohorts on the Flower runtime under distributed DP: each node draws its own units' membership (the
local runtime's draw, from the same keys), ignores the server's, and its counts never reach the server (the
records hold the plan's units, never |S|); the run equals the local runtime's bit for bit, ledger and round
records included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedpers import config
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.privacy import distributed as dist
from fedpers.runner import resolve
from fedpers.runtime.flower import codec, nodeside
from fedpers.runtime.local import run_local
from tests.flower_support import InProcessGrid
from tests.small_runs import FEDREP_SMALL, NOISYGD_SMALL
from tests.test_dishonest_server import RecordingGrid
from tests.test_distributed_flower import lab_app, on_flower

POISSON = dict(
    n_users=160, dim=5, rank=2, samples_per_user=16, rounds=3, baselines="none", epsilon=2.0,
    cohorts="poisson", sampling_rate=0.25,
)  # fmt: skip


def _plan(runtime: str, **options: object) -> Any:
    cfg = config.build(AltMinConfig, POISSON)
    opts = {"nodes": 4, "runtime": runtime, "dp_model": "distributed", "bits": 16, **options}
    return resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, opts))


def test_poisson_cohorts_on_flower_equal_the_local_runtime_bit_for_bit() -> None:
    """Same seeds: U, the ledger (sampled Skellam events) and every round's records equal the local runtime's; the
    records hold the units the plan made eligible (all 160 each round: never |S|) and no zeroed count, and no
    node's reply carries a count (0) or anything beside its masked statistics."""
    local = _plan("local")
    state_local, records_local = run_local(
        local.protocol, local.experiment.unit_source(local.cfg), local.privatizer, progress=False
    )
    flower = _plan("flower")
    grid = RecordingGrid(lab_app(POISSON), 4)  # every run goes through SecAgg+ (distributed DP)
    state_flower, records_flower = on_flower(flower, grid)
    torch.testing.assert_close(state_flower["U"], state_local["U"], rtol=0, atol=0)
    assert flower.privatizer.ledger == local.privatizer.ledger
    assert [(r.units, r.zeroed) for r in records_flower] == [(r.units, r.zeroed) for r in records_local]
    assert {(r.units, r.zeroed) for r in records_flower} == {(160, None)}  # the plan's, not the sample's
    assert all(r.diagnostics["expected_sampled_users"] == 0.25 * 160 for r in records_flower[1:])
    assert all("sampled_users" not in r.diagnostics for r in records_flower)
    replies = [codec.decode_reply(m.content) for m in grid.received if m.metadata.message_type == "train"]
    specs = {s.name for s in flower.protocol.stat_specs(1)}
    assert replies and all(r.count == r.zeroed == 0 and set(r.stats) <= specs | {"W"} for r in replies)


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("fedrep", {**FEDREP_SMALL, "n_users": 80, "rounds": 3, "cohorts": "poisson", "sampling_rate": 0.3}),
        ("noisygd", {**NOISYGD_SMALL, "examples": 200, "steps": 3, "cohorts": "poisson", "sampling_rate": 0.3}),
    ],
)
def test_fedrep_and_noisygd_poisson_cohorts_on_flower_equal_the_local_runtime(
    name: str, values: dict[str, Any]
) -> None:
    """The other protocols whose nodes draw Poisson memberships: state, ledger and round counts as on the local runtime."""
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    opts = {"nodes": 4, "dp_model": "distributed", "bits": 16}
    local = resolve(exp, cfg, config.build(RuntimeOptions, opts))
    state_local, records_local = run_local(
        local.protocol, local.experiment.unit_source(local.cfg), local.privatizer, progress=False
    )
    flower = resolve(exp, cfg, config.build(RuntimeOptions, {**opts, "runtime": "flower"}))
    state_flower, records_flower = on_flower(flower, InProcessGrid(lab_app(values, name), 4))
    assert flower.privatizer.ledger == local.privatizer.ledger
    assert [r.units for r in records_flower] == [r.units for r in records_local]
    for key, value in state_local.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state_flower[key], value), key


@pytest.mark.parametrize("server", ["everyone", "no one"])
def test_a_node_ignores_the_membership_the_server_sends(server: str) -> None:
    """A node's vector for a sampled round is the same whatever ``sampled`` the server broadcasts (everyone or no
    one sampled), equal to the one it computes from its own draw; its own counts (kept for its operator) are
    those of its own draw, and the message carries none."""
    p = _plan("flower")
    job_units = p.experiment.units(p.cfg, torch.arange(40, 80))
    protocol = p.protocol
    plan = p.privatizer.plan
    U = torch.linalg.qr(torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    settings = nodeside.NodeSettings(noise_seed=11)
    sent = torch.ones(160, dtype=torch.float64) if server == "everyone" else torch.zeros(160, dtype=torch.float64)
    honest = torch.zeros(160, dtype=torch.float64)  # any membership: the node draws its own
    got = [
        nodeside.node_message(protocol, 1, {"U": U, "sampled": s}, job_units, 40, 80, plan, 1, settings, 160)
        for s in (sent, honest)
    ]
    assert set(got[0][0].stats) == set(got[1][0].stats) == {s.name for s in protocol.stat_specs(1)}
    for name in got[0][0].stats:
        assert torch.equal(got[0][0].stats[name], got[1][0].stats[name])
    mine = dist.node_membership(11, 1, torch.arange(40, 80), 0.25, secure=False)
    assert got[0][1] == got[1][1] == nodeside.NodeCounts(1, int(mine.sum()), 0)
    assert (got[0][0].count, got[0][0].zeroed) == (0, 0)


def test_min_units_counts_the_cohort_before_the_draw_under_poisson_cohorts() -> None:
    """Under distributed DP a node's policy check of min-units under Poisson cohorts counts its units in the round's
    cohort, whatever membership the broadcast holds: a refusal on its own sampled count would tell the server how
    many were sampled."""
    from fedpers.runtime.flower.client import units_contributed

    p = _plan("flower")
    units = p.experiment.units(p.cfg, torch.arange(40, 80))
    U = torch.eye(5, 2, dtype=torch.float64)
    for sampled in (torch.zeros(160, dtype=torch.float64), torch.ones(160, dtype=torch.float64)):
        assert units_contributed(p.protocol, 1, {"U": U, "sampled": sampled}, units, own_draw=True) == 40
    # central DP: the server drew the sample and knows it, so the check counts the sampled users it names
    assert units_contributed(p.protocol, 1, {"U": U, "sampled": torch.zeros(160, dtype=torch.float64)}, units) == 0


@pytest.mark.slow  # starts Ray (~1 min on a busy machine)
def test_ray_simulation_with_poisson_cohorts_equals_the_local_runtime(tmp_path: Any) -> None:
    """Poisson cohorts through Flower's simulation engine (each node a Ray actor drawing its own membership):
    the same U, ledger and per-round unit counts (the plan's) as the local runtime."""
    import json

    import numpy as np

    from fedpers.runner import execute

    cfg = config.build(AltMinConfig, POISSON)
    opts = {"nodes": 4, "dp_model": "distributed", "bits": 16, "client_cpus": 1.0}
    execute(AltMinExperiment(), cfg, config.build(RuntimeOptions, opts), out=tmp_path / "l", progress=False)
    flower = config.build(RuntimeOptions, {**opts, "runtime": "flower"})
    execute(AltMinExperiment(), cfg, flower, out=tmp_path / "f", progress=False)
    U = [np.load(tmp_path / run / "final_state.npz")["U"] for run in ("l", "f")]
    assert np.array_equal(U[0], U[1])
    assert (tmp_path / "f" / "ledger.json").read_text() == (tmp_path / "l" / "ledger.json").read_text()
    units = [
        [json.loads(line)["units"] for line in (tmp_path / run / "rounds.jsonl").read_text().splitlines()]
        for run in ("l", "f")
    ]
    assert units[0] == units[1] == [160] * len(units[0])  # the plan's eligible units: the sample's size is not released
