"""Distributed and local DP on the Flower runtime: the nodes noise their own sums, and the run equals
the local runtime's simulated nodes for one seed (same U, same ledger)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fedpers import config
from fedpers.app import make_client_app, run_flower
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.privacy.accountant import Calibrations
from fedpers.runner import resolve
from fedpers.runtime.driver import RoundFailed
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.nodeside import NODE_SIDE, plan_json, read_plan
from fedpers.runtime.local import run_local
from tests.flower_support import InProcessGrid

SMALL = dict(n_users=120, dim=5, rank=2, samples_per_user=16, rounds=2, baselines="none", epsilon=2.0)


def lab_app(values: dict[str, Any] | None = None, algorithm: str = "altmin") -> Any:
    """The simulation's ClientApp as the lab builds it: the nodes' noise seeded like the local runtime's."""
    from fedpers.experiments import EXPERIMENTS
    from fedpers.seeds import split_seed

    exp = EXPERIMENTS[algorithm]
    return make_client_app(noise_seed=split_seed(config.build(exp.config_type, values or SMALL))[1])


def plan(runtime: str, **options: object) -> Any:
    cfg = config.build(AltMinConfig, SMALL)
    return resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, {"nodes": 4, "runtime": runtime, **options}))


def on_flower(p: Any, grid: InProcessGrid) -> tuple[Any, list[Any]]:
    table = p.calibrations.table
    return run_flower(
        p.experiment,
        p.cfg,
        p.protocol,
        p.privatizer,
        p.options,
        grid=grid,
        progress=False,
        calibrations=table,
        node_protocol=p.experiment.protocol(p.cfg, Calibrations(table)),
    )


@pytest.mark.parametrize("model", ["distributed", "local"])
def test_flower_nodes_noise_their_sums_and_equal_the_local_runtime(model):
    opts = {"dp_model": model, "bits": 16} if model == "distributed" else {"dp_model": model}
    local = plan("local", **opts)
    state_local, _ = run_local(
        local.protocol, local.experiment.unit_source(local.cfg), local.privatizer, progress=False
    )
    flower = plan("flower", **opts)
    grid = InProcessGrid(lab_app(), 4)
    state_flower, records = on_flower(flower, grid)
    torch.testing.assert_close(state_flower["U"], state_local["U"], rtol=0, atol=1e-12)
    assert flower.privatizer.ledger == local.privatizer.ledger
    assert all(r.diagnostics["nodes_survived"] == 4 for r in records)
    tasks = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert tasks and all(NODE_SIDE in m.content.config_records for m in tasks)
    if model == "distributed":  # what each node sent is an integer vector mod 2^b, never its statistics
        rec = tasks[0].content.config_records[NODE_SIDE]
        assert read_plan(str(rec["plan"])) == flower.privatizer.plan
        assert plan_json(read_plan(str(rec["plan"]))) == plan_json(flower.privatizer.plan)


def test_flower_round_with_fewer_answering_nodes_than_min_nodes_releases_nothing():
    p = plan("flower", dp_model="distributed", bits=16, min_nodes=4, round_timeout=0.3)
    with pytest.raises(RoundFailed, match="min_nodes=4"):
        on_flower(p, InProcessGrid(lab_app(), 4, silent={2}))
    assert len(p.privatizer.ledger.releases) == 0


def test_flower_node_refuses_a_malformed_plan():
    from fedpers.runtime.flower.nodeside import NodeSideGather  # noqa: F401  (module imports without Ray)

    with pytest.raises(ValueError, match=NODE_SIDE):
        read_plan('{"model": "distributed"}')
    assert codec.TAG  # the reply still travels as a tagged fedpers reply


# ----- sweeps that set runtime options ------------------------------------------------------------
def test_trust_model_sweeps_load_and_a_point_runs_with_its_runtime_options():
    from pathlib import Path

    from fedpers.sweeps.points import run_point_task
    from fedpers.sweeps.spec import load_spec

    root = Path(__file__).resolve().parents[1] / "simulations"
    for algorithm in ("altmin", "fedrep"):
        spec = load_spec(root / f"trust_models_{algorithm}.toml")
        labels = {label for label, _ in spec.points()}
        assert labels == {"central", *(f"distributed b={b}" for b in (8, 12, 16, 20)), "local", "non-private"}
    tiny = dataclasses.replace(
        load_spec(root / "trust_models_altmin.toml"),
        base={**SMALL, "nodes": 4},
        repetitions=1,
    )
    rows, runs = run_point_task(tiny, {"epsilon": 2.0, "dp_model": "distributed", "bits": 16})
    result = __import__("json").loads(runs["r0"]["result.json"])
    assert result["privacy"]["trust_model"]["dp_model"] == "distributed"
    assert result["privacy"]["trust_model"]["bits"] == 16 and result["privacy"]["trust_model"]["nodes"] == 4
    assert rows[0]["subspace_error"] == pytest.approx(result["subspace_error"])
    with pytest.raises(ValueError, match="bits"):
        run_point_task(tiny, {"epsilon": 2.0, "dp_model": "distributed", "bits": 40})


@pytest.mark.slow
def test_the_trust_model_sweep_set_runs_every_member_through_fedpers_sweep(tmp_path):
    """`fedpers sweep simulations/trust_models.toml` is a sweep set of the two per-algorithm sweeps; a tiny
    copy of it runs both members into OUT/<name>: every series, the refused one (too few bits for n units)
    recorded with its reason while the sweep goes on, the non-private reference line, the wrap counts as
    columns (blank without a modular sum); simulations/trust_models.py makes the table from those records."""
    import csv
    import importlib.util
    import json
    import math
    from pathlib import Path

    from fedpers.commands.cli import main
    from fedpers.sweeps.points import run_point_task
    from fedpers.sweeps.sets import sweep_set
    from fedpers.sweeps.spec import load_spec

    root = Path(__file__).resolve().parents[1] / "simulations"
    found = sweep_set(root / "trust_models.toml")
    assert found is not None and [f.name for f in found[1]] == ["trust_models_altmin.toml", "trust_models_fedrep.toml"]
    for real in map(load_spec, found[1]):  # the figure's grid: b = 8, the non-private line, the wrap counts
        assert {"central", "distributed b=8", "distributed b=16", "local"} <= set(real.series_values)
        assert real.references == {"non-private": {"epsilon": math.inf}}
        assert real.columns == ("modular_wraps", "suspected_wraps") and real.repetitions == 5
        over = dict(real.points())["distributed b=8"]  # refused at n = 4000 before any release, not an error
        rows, runs = run_point_task(dataclasses.replace(real, repetitions=1), over)
        assert runs == {} and "bits=8 cannot hold a sum of 4000 units" in rows[0]["refused"]
    for algorithm, samples in (("altmin", 16), ("fedrep", 5)):
        (tmp_path / f"{algorithm}.toml").write_text(
            f'name = "trust_models_{algorithm}"\nalgorithm = "{algorithm}"\nx = "epsilon"\nseries = "trust_model"\n'
            'metrics = ["subspace_error"]\ncolumns = ["modular_wraps", "suspected_wraps"]\n'
            f"[base]\nn_users = 120\ndim = 5\nrank = 2\nsamples_per_user = {samples}\nrounds = 1\n"
            'baselines = "none"\nnodes = 4\n[grid]\nepsilon = [2.0]\n[series_values]\n'
            'central = { dp_model = "central" }\n"distributed b=6" = { dp_model = "distributed", bits = 6 }\n'
            '"distributed b=16" = { dp_model = "distributed", bits = 16 }\n'
            '[references]\n"non-private" = { epsilon = inf }\n'
        )
    (tmp_path / "set.toml").write_text('name = "tiny"\nsweeps = ["altmin.toml", "fedrep.toml"]\n')
    out = tmp_path / "out"
    assert main(["sweep", str(tmp_path / "set.toml"), "--out", str(out), "--quiet"]) == 0
    assert (out / "subspace_error.png").stat().st_size > 0  # the set's figure: both algorithms side by side
    for algorithm in ("altmin", "fedrep"):
        with (out / f"trust_models_{algorithm}" / "table.csv").open() as f:
            rows = {r["trust_model"]: r for r in csv.DictReader(f)}
        assert set(rows) == {"central", "distributed b=6", "distributed b=16", "non-private"}
        assert (
            "bits=6 cannot hold" in rows["distributed b=6"]["refused"]
            and rows["distributed b=6"]["subspace_error"] == ""
        )
        assert (
            float(rows["distributed b=16"]["modular_wraps"]) == 0 == float(rows["distributed b=16"]["suspected_wraps"])
        )
        assert rows["central"]["modular_wraps"] == "" and rows["central"]["suspected_wraps"] == ""
        assert rows["non-private"]["epsilon"] == "inf"
        assert float(rows["non-private"]["subspace_error"]) < 0.5 * float(rows["central"]["subspace_error"])
        summary = json.loads((out / f"trust_models_{algorithm}" / "sweep.json").read_text())
        assert list(summary["refused"]) == ["distributed b=6"]
    spec = importlib.util.spec_from_file_location("trust_models", root / "trust_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(out)])
    table = (out / "table.md").read_text()
    assert "| altmin | distributed b=16 | 2 | 1 |" in table and "| fedrep | non-private | inf | 1 |" in table
    assert "altmin, distributed b=6: refused before any release: bits=6" in table
    assert (out / "trust_models.png").stat().st_size > 0
    (tmp_path / "bad.toml").write_text('sweeps = ["altmin.toml", "missing.toml"]\n')
    with pytest.raises(ValueError, match="no such file"):
        sweep_set(tmp_path / "bad.toml")


# ----- DPALS and NoisyGD under distributed and local DP --------------------------------------------
@pytest.mark.parametrize("name", ["dpals", "noisygd"])
def test_dpals_and_noisygd_run_distributed_within_their_target_with_skellam_releases(name):
    from fedpers.experiments import EXPERIMENTS
    from fedpers.privacy.accountant import ledger_epsilon
    from fedpers.privacy.ledger import SkellamDpEvent

    exp = EXPERIMENTS[name]
    values: dict[str, object] = {"epsilon": 2.0}
    values.update(
        {"n_users": 300, "steps": 2} if name == "dpals" else {"examples": 400, "steps": 3, "baselines": "none"}
    )
    cfg = config.build(exp.config_type, values)
    p = resolve(exp, cfg, config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "bits": 16}))
    state, _ = run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    releases = p.privatizer.ledger.releases
    assert releases and all(isinstance(r.event, SkellamDpEvent) for r in releases)
    assert 0.97 * 2.0 <= ledger_epsilon(p.privatizer.ledger, cfg.delta) <= 2.0
    on = resolve(
        exp, cfg, config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "bits": 16, "runtime": "flower"})
    )
    state_flower, _ = on_flower(on, InProcessGrid(lab_app(values, name), 4))
    assert on.privatizer.ledger == p.privatizer.ledger
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(state_flower[key], value, rtol=0, atol=1e-6)
    local = resolve(exp, cfg, config.build(RuntimeOptions, {"nodes": 4, "dp_model": "local"}))
    run_local(local.protocol, local.experiment.unit_source(local.cfg), local.privatizer, progress=False)
    assert {r.mechanism for r in local.privatizer.ledger.releases} == {"local_gaussian"}
    assert ledger_epsilon(local.privatizer.ledger, cfg.delta) <= 2.0 * (1 + 1e-9)


def test_noisyhead_statistics_mode_and_correlated_noise_stay_refused_under_node_side_models():
    """NoisyHead's statistics mode releases A·Γ − b (a server-side transform of the sums) and its
    correlated noise spans steps: neither is a sum the nodes can noise, refused before any work."""
    from fedpers.experiments import EXPERIMENTS

    exp = EXPERIMENTS["noisyhead"]
    for values, why in (
        ({"epsilon": 2.0}, "mode statistics"),
        ({"epsilon": 2.0, "mode": "rounds", "noise": "banded", "steps": 3}, "correlated noise"),
        ({"epsilon": 2.0, "mode": "rounds", "calibration": "paper", "steps": 3}, "not calibrated by the accountant"),
    ):
        cfg = config.build(exp.config_type, values)
        for model in ("distributed", "local"):
            with pytest.raises(ValueError, match=why):
                resolve(exp, cfg, config.build(RuntimeOptions, {"nodes": 4, "dp_model": model}))


def test_noisyhead_user_level_rounds_run_distributed_and_local_within_their_target():
    """NoisyHead at the user level in rounds mode: every step's gradient sum is a Skellam release
    (ε within [0.97, 1]·target, above central's z), the Flower run (SecAgg+) equals the local
    runtime's Γ and ledger; under local DP every release is a local Gaussian within the target."""
    from fedpers.experiments import EXPERIMENTS
    from fedpers.privacy.accountant import ledger_epsilon
    from fedpers.privacy.ledger import SkellamDpEvent

    exp = EXPERIMENTS["noisyhead"]
    values = {"epsilon": 2.0, "mode": "rounds", "unit": "user", "prompts_per_user": 4, "steps": 2, "prompts": 400}
    cfg = config.build(exp.config_type, values)
    opts = {"nodes": 4, "dp_model": "distributed", "bits": 16}
    p = resolve(exp, cfg, config.build(RuntimeOptions, opts))
    central = resolve(exp, cfg, config.build(RuntimeOptions, {}))
    assert p.privatizer.plan.noise_multiplier > 0 and p.protocol.noise_multiplier >= central.protocol.noise_multiplier
    state, _ = run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    releases = p.privatizer.ledger.releases
    assert len(releases) == 2 and all(isinstance(r.event, SkellamDpEvent) for r in releases)
    assert 0.97 * 2.0 <= ledger_epsilon(p.privatizer.ledger, cfg.delta) <= 2.0
    on = resolve(exp, cfg, config.build(RuntimeOptions, {**opts, "runtime": "flower"}))
    state_flower, _ = on_flower(on, InProcessGrid(lab_app(values, "noisyhead"), 4))
    assert on.privatizer.ledger == p.privatizer.ledger
    torch.testing.assert_close(state_flower["gamma"], state["gamma"], rtol=0, atol=1e-9)
    local = resolve(exp, cfg, config.build(RuntimeOptions, {"nodes": 4, "dp_model": "local"}))
    run_local(local.protocol, local.experiment.unit_source(local.cfg), local.privatizer, progress=False)
    assert {r.mechanism for r in local.privatizer.ledger.releases} == {"local_gaussian"}
    assert ledger_epsilon(local.privatizer.ledger, cfg.delta) <= 2.0 * (1 + 1e-9)


@pytest.mark.slow  # starts Ray (~1 min on a busy machine)
def test_ray_simulation_under_distributed_dp_equals_the_local_runtime(tmp_path):
    """execute on Flower's simulation engine (Ray actors run the nodes): same U and ledger as local."""
    import numpy as np

    from fedpers.runner import execute

    cfg = config.build(AltMinConfig, SMALL)
    opts = {"nodes": 3, "dp_model": "distributed", "bits": 16, "client_cpus": 1.0}
    local = execute(AltMinExperiment(), cfg, config.build(RuntimeOptions, opts), out=tmp_path / "l", progress=False)
    flower = config.build(RuntimeOptions, {**opts, "runtime": "flower"})
    result = execute(AltMinExperiment(), cfg, flower, out=tmp_path / "f", progress=False)
    U = torch.from_numpy(np.load(tmp_path / "f" / "final_state.npz")["U"])
    torch.testing.assert_close(U, local["_state"]["U"], rtol=0, atol=1e-12)
    assert (tmp_path / "f" / "ledger.json").read_text() == (tmp_path / "l" / "ledger.json").read_text()
    assert result["privacy"]["trust_model"]["dp_model"] == "distributed"


def test_flower_nodes_refuse_a_plan_with_less_noise_than_they_derive_from_the_job():
    import dataclasses

    from fedpers.runtime.flower.nodeside import check_plan

    p = plan("flower", dp_model="distributed", bits=16)
    honest = p.privatizer.plan
    weaker = dataclasses.replace(
        honest, encodings={k: dataclasses.replace(e, variance=e.variance / 4) for k, e in honest.encodings.items()}
    )
    p.privatizer.plan = weaker  # a server that asks the nodes for a quarter of the noise
    with pytest.raises(RoundFailed, match="0 of 4 nodes answered"):
        on_flower(p, InProcessGrid(lab_app(), 4))
    assert len(p.privatizer.ledger.releases) == 0
    with pytest.raises(ValueError, match="rule 'plan-noise'.*differs from the one this node derives"):
        check_plan(plan_json(weaker), weaker, honest)
    check_plan(plan_json(honest), honest, honest)
