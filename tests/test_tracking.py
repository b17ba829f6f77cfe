"""--track tensorboard|mlflow: the logs read back with each library's own reader."""

from __future__ import annotations

import itertools
import json

import pytest

from fedpers.commands.cli import main
from fedpers.results.rundir import read_run

ARGS = ["run", "altmin", "--n-users", "400", "--dim", "5", "--rounds", "2", "--quiet"]


@pytest.fixture(autouse=True)
def mlflow_file_store(monkeypatch):
    """The tests read an MLflow file store under tmp_path (MLflow 3 keeps it behind this switch)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("track") / "run"
    assert main(ARGS + ["--out", str(out)]) == 0
    return out


def test_tensorboard_logs_read_back(run_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedpers.commands.tracking import track_run

    track_run(run_dir, "tensorboard", logdir=tmp_path / "tb")
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    result = json.loads((run_dir / "result.json").read_text())
    run = read_run(run_dir)
    eps = acc.Scalars("privacy/epsilon_spent")
    assert len(eps) == len(json.loads(run["ledger_text"]))  # one point per release
    assert [e.step for e in eps] == list(range(1, len(eps) + 1))
    assert all(a.value <= b.value + 1e-6 for a, b in itertools.pairwise(eps))  # ε only grows
    assert eps[-1].value == pytest.approx(result["epsilon"], rel=1e-3)  # the last is the run's ε
    rounds = acc.Scalars("round/subspace_error")
    assert [r.step for r in rounds] == [r["round"] for r in run["rounds"]]
    assert rounds[-1].value == pytest.approx(run["rounds"][-1]["subspace_error"], rel=1e-6)
    assert acc.Scalars("final/excess_risk")[0].value == pytest.approx(result["excess_risk"], rel=1e-6)
    assert acc.Scalars("baseline/local_only/excess_risk")[0].value == pytest.approx(
        result["baselines"]["local_only"]["excess_risk"], rel=1e-6
    )
    assert {f"figure/{p.removesuffix('.png')}" for p in result["plots"]} <= set(tags["images"])
    assert "config/text_summary" in tags["tensors"]


def test_mlflow_logs_read_back(run_dir, tmp_path):
    mlflow = pytest.importorskip("mlflow")

    from fedpers.commands.tracking import track_run

    uri = (tmp_path / "mlruns").as_uri()
    where = track_run(run_dir, "mlflow", uri=uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(where["run_id"])
    result = json.loads((run_dir / "result.json").read_text())
    assert run.info.status == "FINISHED"
    assert run.data.params["n_users"] == "400" and run.data.params["runtime.runtime"] == "local"
    assert run.data.metrics["final/excess_risk"] == pytest.approx(result["excess_risk"], rel=1e-6)
    assert run.data.metrics["baseline/oracle/excess_risk"] == pytest.approx(
        result["baselines"]["oracle"]["excess_risk"], rel=1e-6
    )
    history = client.get_metric_history(where["run_id"], "privacy/epsilon_spent")
    assert sorted(m.step for m in history) == list(range(1, len(history) + 1))
    assert max(m.value for m in history) == pytest.approx(result["epsilon"], rel=1e-3)
    artifacts = {a.path for a in client.list_artifacts(where["run_id"])}
    assert set(result["plots"]) | {"result.json", "config.json"} <= artifacts


def test_cli_track_mlflow_and_missing_extra(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = (tmp_path / "ml").as_uri()
    assert main(ARGS + ["--out", str(tmp_path / "r"), "--track", "mlflow", "--track-uri", uri]) == 0
    runs = mlflow.MlflowClient(tracking_uri=uri).search_runs(
        [mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name("fedpers-altmin").experiment_id]
    )
    assert [r.info.run_name for r in runs] == ["r"]

    import builtins

    real = builtins.__import__

    def no_mlflow(name, *a, **k):
        if name == "mlflow":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    assert main(ARGS + ["--out", str(tmp_path / "r2"), "--track", "mlflow"]) == 2  # refused before any work
    assert not (tmp_path / "r2").exists()


@pytest.mark.slow
def test_sweep_points_grouped(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = tmp_path / "s.toml"
    spec.write_text(
        'name = "tiny"\nalgorithm = "altmin"\nx = "epsilon"\nseries = "dim"\nmetrics = ["excess_risk"]\nrepetitions = 2\n'
        '[base]\nn_users = 400\nbaselines = "none"\n[grid]\ndim = [5]\nepsilon = [1.0, 8.0]\n'
    )
    uri = (tmp_path / "ml").as_uri()
    assert (
        main(["sweep", str(spec), "--out", str(tmp_path / "sw"), "--quiet", "--track", "mlflow", "--track-uri", uri])
        == 0
    )
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fedpers-sweep-tiny")
    runs = client.search_runs([exp.experiment_id])
    points = [r for r in runs if r.info.run_name != "figures"]
    assert len(points) == 2 and {r.data.params["epsilon"] for r in points} == {"1.0", "8.0"}
    assert all(r.data.tags["sweep"] == "tiny" for r in runs)
    for r in points:
        assert len(client.get_metric_history(r.info.run_id, "point/excess_risk")) == 2  # one per repetition

    from fedpers.commands.tracking import track_sweep

    track_sweep(tmp_path / "sw", "tensorboard")
    logdirs = sorted(p.name for p in (tmp_path / "sw" / "tensorboard").iterdir())
    assert logdirs == ["00000", "00001", "figures"]
    acc = EventAccumulator(str(tmp_path / "sw" / "tensorboard" / "00001"))
    acc.Reload()
    assert len(acc.Scalars("point/excess_risk")) == 2


def test_an_unusable_tracking_uri_is_refused_before_any_run_directory_exists(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    from fedpers.commands.cli import main

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "run"
    rc = main(
        [
            "run",
            "dpattention",
            "--columns",
            "2000",
            "--out",
            str(out),
            "--quiet",
            "--track",
            "mlflow",
            "--track-uri",
            f"file:{tmp_path / 'mlruns'}",
        ]
    )
    assert rc == 2 and not out.exists()
    assert "track_uri: MLflow cannot use" in capsys.readouterr().err
