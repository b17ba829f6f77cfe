"""A sweep computes each non-private baseline once per data set and seed, keeps it in the sweep
directory and hands it to every point that shares them (fedpers/sweeps/baselines.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments import altmin as am
from fedpers.runner import execute
from fedpers.sweeps.run import run_sweep

SWEEP = """
algorithm = "altmin"
x = "epsilon"
series = "n_users"
metrics = ["subspace_error", "baselines.oracle.excess_risk", "baselines.nonprivate_altmin.subspace_error"]
[base]
dim = 4
rank = 2
samples_per_user = 8
[grid]
n_users = [300, 400]
epsilon = [1.0, 4.0, 16.0]
"""


@pytest.fixture
def computed(monkeypatch):
    """n_users of every run that computed its non-private reference (the costly shared baseline)."""
    calls: list[int] = []
    real = am.AltMinEvaluator.with_reference

    def counting(self, fits, start):
        calls.append(self.cfg.n_users)
        return real(self, fits, start)

    monkeypatch.setattr(am.AltMinEvaluator, "with_reference", counting)
    return calls


def _results(out):
    """(n_users, ε) → the result.json of each point's run."""
    found = {}
    for p in sorted((out / "points").glob("*-r0")):
        cfg = json.loads((p / "config.json").read_text())
        found[(cfg["n_users"], float(cfg["epsilon"]))] = json.loads((p / "result.json").read_text())
    return found


def test_points_that_share_data_compute_the_baselines_once_and_reuse_them_after_a_resume(tmp_path, computed):
    path = tmp_path / "s.toml"
    path.write_text(SWEEP)
    run_sweep(path, out=tmp_path / "out", progress=False)
    assert computed == [300, 400]  # once per data set (n_users), never per ε
    results = _results(tmp_path / "out")
    shared = am.SHARED_BASELINES
    for (n, eps), r in results.items():
        leader = results[(n, 1.0)]
        assert {k: r["baselines"][k] for k in shared} == {k: leader["baselines"][k] for k in shared}
        assert r.get("baselines_reused", []) == ([] if eps == 1.0 else sorted(shared))
        assert r["baselines"]["private_init_only"] != leader["baselines"]["private_init_only"] or eps == 1.0  # ε's own
    kept = sorted((tmp_path / "out" / "baselines").glob("*.json"))
    assert len(kept) == 2 and {json.loads(k.read_text())["key"]["n_users"] for k in kept} == {300, 400}
    assert all("epsilon" not in json.loads(k.read_text())["key"] for k in kept)

    # a sweep killed before its last point: the resumed one reruns that point and reuses the kept baselines
    last = sorted((tmp_path / "out" / "points").glob("[0-9]*.json"))[-1]
    last.unlink()
    computed.clear()
    summary = run_sweep(path, out=tmp_path / "out", progress=False)
    assert summary["points_run"] == 1 and computed == []
    assert _results(tmp_path / "out")[(400, 16.0)]["baselines_reused"] == sorted(shared)


def test_reused_baselines_are_what_the_point_computes_alone():
    """A point handed the shared rows reports what it would have computed itself: the rows depend on
    the data and the seed, not on ε or the neighbouring relation (the private fit and the private
    initialisation are its own)."""
    exp = EXPERIMENTS["altmin"]
    values = {"n_users": 300, "dim": 4, "rank": 2, "samples_per_user": 8, "seed": 5}
    relation = {1.0: "add-remove", 8.0: "replace-one"}
    alone = {
        eps: execute(
            exp,
            config.build(exp.config_type, {**values, "epsilon": eps, "neighbours": relation[eps]}),
            write=False,
            progress=False,
        )
        for eps in (1.0, 8.0)
    }
    rows = {k: alone[1.0]["baselines"][k] for k in am.SHARED_BASELINES}
    cfg = config.build(exp.config_type, {**values, "epsilon": 8.0})
    given = execute(exp, cfg, write=False, progress=False, reuse=rows)
    for k in am.SHARED_BASELINES:
        for metric, value in alone[8.0]["baselines"][k].items():
            assert given["baselines"][k][metric] == pytest.approx(value, rel=1e-12, abs=1e-15), (k, metric)
    assert given["subspace_error"] == alone[8.0]["subspace_error"]
    assert given["baselines"]["private_init_only"] == alone[8.0]["baselines"]["private_init_only"]
    assert list(given["baselines"]) == list(alone[8.0]["baselines"])  # the same order as a run computing them all


def test_the_key_is_every_field_but_the_privacy_ones():
    """Change ε, δ, the accountant, the neighbouring relation or the calibration: the same key (reused). Change any data field,
    the seed or a baseline's own parameter: another key (computed again)."""
    exp = EXPERIMENTS["altmin"]
    base = config.build(exp.config_type, {"n_users": 300, "dim": 4, "rank": 2})
    key = exp.baseline_key(base)
    same = [
        {"epsilon": 2.0},
        {"epsilon": math.inf},
        {"delta": 1e-6},
        {"accountant": "rdp"},
        {"neighbours": "add-remove"},
        {"calibration": "paper"},
    ]
    for change in same:
        assert exp.baseline_key(replace(base, **{k: type(getattr(base, k))(v) for k, v in change.items()})) == key, (
            change
        )
    other = [
        {"n_users": 301},
        {"noise_std": 0.2},
        {"samples_per_user": 20},
        {"seed": 1},
        {"clip_model": 0.5},
        {"rounds": 3},
        {"baselines": "oracle"},
    ]
    for change in other:
        assert exp.baseline_key(replace(base, **change)) != key, change
    assert EXPERIMENTS["noisyhead"].baseline_key(config.build(EXPERIMENTS["noisyhead"].config_type, {})) is None


def test_a_data_file_that_changes_is_another_key(tmp_path):
    import numpy as np

    exp = EXPERIMENTS["altmin"]
    data = tmp_path / "users.npz"
    g = np.random.default_rng(0)
    np.savez(data, x=g.normal(size=(40, 8, 4)), y=g.normal(size=(40, 8)))
    cfg = config.build(exp.config_type, {"data": str(data), "rank": 2})
    key = exp.baseline_key(cfg)
    np.savez(data, x=g.normal(size=(40, 8, 4)), y=g.normal(size=(40, 8)) + 1.0)
    assert exp.baseline_key(cfg) != key


SMALL = {
    "fedrep": {"n_users": 400, "dim": 4, "rank": 2, "rounds": 2, "cohorts": "all"},
    "noisygd": {"examples": 600, "feature_dim": 12, "steps": 3},
    "dpals": {"n_users": 200, "n_items": 30, "rank": 3, "true_rank": 3, "steps": 2, "head_items": 20},
    "expmech": {"n_users": 300, "dim": 3, "rank": 1},
}


def _close(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-12, abs=1e-15), where
    else:
        assert a == b, where


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n != "expmech" else n for n in sorted(SMALL)]
)  # expmech's in the default suite: its candidates score every sample, whatever a reuse leaves out
def test_every_sharing_experiment_reports_what_it_would_compute(name):
    """FedRep's reference, NoisyGD's non-private GD, DPALS's tuned ALS, ExpMech's AltMin baselines:
    handed over from a run at another ε, they are what the run computes alone, and its own figures
    (the private ones) are unchanged."""
    exp = EXPERIMENTS[name]
    runs = {
        eps: execute(
            exp, config.build(exp.config_type, {**SMALL[name], "epsilon": eps, "seed": 2}), write=False, progress=False
        )
        for eps in (1.0, 4.0)
    }
    cfg = config.build(exp.config_type, {**SMALL[name], "epsilon": 4.0, "seed": 2})
    rows = exp.shared_rows(cfg, runs[1.0])
    assert rows and set(rows) == set(exp.shared_baselines(cfg))
    given = execute(exp, cfg, write=False, progress=False, reuse=rows)
    assert given["baselines_reused"] == sorted(rows)
    alone = {k: v for k, v in runs[4.0].items() if not k.startswith("_") and k not in ("seconds", "run_dir")}
    got = {
        k: v for k, v in given.items() if not k.startswith("_") and k not in ("seconds", "run_dir", "baselines_reused")
    }
    _close(alone, got)
    assert exp.baseline_key(cfg) == exp.baseline_key(replace(cfg, epsilon=1.0))
