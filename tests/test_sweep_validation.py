"""A sweep file is checked before any point runs: each bad key kind is refused by name."""

from __future__ import annotations

import pytest

from fedpers.sweeps.run import load_spec, run_sweep

GOOD = """
algorithm = "altmin"
x = "n_users"
series = "epsilon"
metrics = ["subspace_error"]
[base]
dim = 4
[grid]
n_users = [200, 400]
epsilon = [1.0]
"""


def write(tmp_path, text: str):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.replace('x = "n_users"', 'x = "n_user"'), "x = 'n_user' is not a config field"),
        (lambda t: t.replace('series = "epsilon"', 'series = "eps"'), "series = 'eps' is not a config field"),
        (
            lambda t: t.replace('metrics = ["subspace_error"]', 'metrics = "subspace_error"'),
            "metrics must be a non-empty list",
        ),
        (lambda t: "grid = 5\n" + t.split("[grid]")[0], r"\[grid\] must be a table"),
        (lambda t: t + "[series_values]\na = 5\n", "series_values.a must be a table"),
        (lambda t: t.replace("n_users = [200, 400]", "n_users = []"), "grid.n_users is an empty list"),
        (lambda t: "colour = 1\n" + t, r"unknown key\(s\) \['colour'\]"),
        (lambda t: "repetitions = 2.7\n" + t, "repetitions must be an integer >= 1"),
        (lambda t: t + '[plot]\nxscale = "logarithmic"\n', "plot.xscale must be one of"),
        (lambda t: t.replace("dim = 4", "dimm = 4"), "base key 'dimm' is not a config field"),
        (lambda t: t.replace("epsilon = [1.0]", "epsilon = [1.0]\nrounds = [true]"), "rounds must be of type int"),
        (lambda t: t + "[references]\nnp = 5\n", "references.np must be a table"),
        (lambda t: t + "[references]\nnp = { epsilonn = 1.0 }\n", "epsilonn"),
        (lambda t: t + "[series_values]\na = { dim = 5 }\n[references]\na = { dim = 6 }\n", "reuse series labels"),
        (lambda t: 'columns = "modular_wraps"\n' + t, "columns must be a list"),
        (lambda t: 'columns = ["modular_wrap"]\n' + t, r"column\(s\) \['modular_wrap'\] not in altmin's result"),
        (lambda t: t.replace("dim = 4", "dim = 4\nepsilon = 2.0"), r"\['epsilon'\] in both \[base\] and \[grid\]"),
        (lambda t: t.replace('x = "n_users"', 'x = "epsilon"'), "x and series are both 'epsilon'"),
        (
            lambda t: t.replace("n_users = [200, 400]", "n_users = [200, 400, 200]"),
            "grid.n_users lists 200 more than once",
        ),
    ],
)
def test_bad_sweep_files_are_refused_naming_the_key(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        load_spec(write(tmp_path, change(GOOD)))


def test_a_misspelt_metric_is_refused_before_any_point_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """Metrics are checked against the algorithm's declared result keys before any point runs;
    the refused sweep leaves no directory, so the corrected file runs into the same --out."""
    import fedpers.sweeps.points as points

    real, calls = points.run_point_task, []
    monkeypatch.setattr(
        points, "run_point_task", lambda spec, o, threads=0, reuse=None: calls.append(o) or real(spec, o, reuse=reuse)
    )
    for wrong, match in (
        ('"subspace_eror"', r"metric\(s\) \['subspace_eror'\] not in altmin's result; available: .*subspace_error"),
        ('"baselines.oracl.subspace_error"', r"baselines.NAME.METRIC with NAME in nonprivate_altmin, .*oracle"),
    ):
        with pytest.raises(ValueError, match=match):
            run_sweep(write(tmp_path, GOOD.replace('"subspace_error"', wrong)), out=tmp_path / "out", progress=False)
        assert calls == [] and not (tmp_path / "out").exists()
    summary = run_sweep(
        write(
            tmp_path,
            GOOD.replace('"subspace_error"', '"subspace_error", "baselines.oracle.subspace_error", "privacy.epsilon"'),
        ),
        out=tmp_path / "out",
        progress=False,
    )
    assert summary["points_run"] == 2 and len(calls) == 2


def test_a_sweep_failing_at_its_first_point_leaves_nothing_behind(tmp_path, monkeypatch):
    import fedpers.sweeps.points as points

    def fails(spec, overrides, threads=0, reuse=None):
        raise ValueError("sweep: metric(s) ['excess_risk'] not in this point's result")

    monkeypatch.setattr(points, "run_point_task", fails)
    with pytest.raises(ValueError, match="not in this point's result"):
        run_sweep(write(tmp_path, GOOD), out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError):
        run_sweep(write(tmp_path, GOOD), out=tmp_path / "kept", progress=False)
    assert (tmp_path / "kept" / "notes.txt").read_text() == "mine"  # a directory it did not create is never removed


def test_every_algorithm_declares_its_result_keys():
    from fedpers.experiments import EXPERIMENTS

    for name, exp in EXPERIMENTS.items():
        assert exp.primary_metric in exp.result_keys, name


def test_an_interrupted_sweep_resumes_running_only_missing_points(tmp_path, monkeypatch):
    import csv

    import fedpers.sweeps.points as sweep

    path = write(tmp_path, GOOD.replace("n_users = [200, 400]", "n_users = [200, 300, 400]"))
    real, calls = sweep.run_point_task, []

    def dies_at_third(spec, overrides, threads=0, reuse=None):
        calls.append(overrides["n_users"])
        if len(calls) == 3:
            raise KeyboardInterrupt  # the sweep is killed during its third point
        return real(spec, overrides, reuse=reuse)

    monkeypatch.setattr(sweep, "run_point_task", dies_at_third)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, out=tmp_path / "out", progress=False)
    monkeypatch.setattr(
        sweep,
        "run_point_task",
        lambda spec, o, threads=0, reuse=None: calls.append(o["n_users"]) or real(spec, o, reuse=reuse),
    )
    summary = run_sweep(path, out=tmp_path / "out", progress=False)
    assert calls == [200, 300, 400, 400] and summary["points_run"] == 1 and summary["points_reused"] == 2
    with open(tmp_path / "out" / "table.csv") as f:
        resumed = list(csv.DictReader(f))
    assert [r["n_users"] for r in resumed] == ["200", "300", "400"]
    monkeypatch.setattr(sweep, "run_point_task", real)
    fresh = run_sweep(path, out=tmp_path / "fresh", progress=False)
    with open(tmp_path / "fresh" / "table.csv") as f:
        assert [r["subspace_error"] for r in csv.DictReader(f)] == [r["subspace_error"] for r in resumed]
    assert fresh["points_run"] == 3
    other = write(tmp_path, GOOD.replace("epsilon = [1.0]", "epsilon = [2.0]"))
    with pytest.raises(ValueError, match="holds a different sweep"):
        run_sweep(other, out=tmp_path / "out", progress=False)
