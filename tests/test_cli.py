"""The command line end to end: JSON keys, run directory, data files, refusals, privacy report."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedpers.commands.cli import main
from fedpers.data import synthetic
from fedpers.data.files import save_altmin_npz

SMALL = ["--n-users", "600", "--dim", "6", "--rank", "2", "--samples-per-user", "8", "--rounds", "2"]


def run_json(capsys, *args):
    assert main(["run", "altmin", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_sweep_json_is_one_object_on_stdout_like_run_compare_and_privacy(tmp_path, capsys):
    """`fedpers sweep --json`, as `run --json`: stdout is one JSON object (the summary sweep.json holds, with
    the sweep's directory and its table's rows), the lines a reader follows go to stderr; `--select` prints
    its selection the same way."""
    spec = tmp_path / "s.toml"
    spec.write_text(
        'name = "tiny"\nalgorithm = "altmin"\nx = "epsilon"\nseries = "dim"\nmetrics = ["excess_risk"]\n'
        '[base]\nn_users = 400\nbaselines = "none"\n[grid]\ndim = [5]\nepsilon = [1.0, 8.0]\n'
    )
    out = tmp_path / "sw"
    assert main(["sweep", str(spec), "--out", str(out), "--json"]) == 0
    printed = capsys.readouterr()
    r = json.loads(printed.out)
    on_disk = json.loads((out / "sweep.json").read_text())
    assert {k: r[k] for k in on_disk} == on_disk and r["points_run"] == 2 and r["out"] == str(out)
    assert [row["epsilon"] for row in r["table_rows"]] == [1.0, 8.0]
    assert all(isinstance(row["excess_risk"], float) for row in r["table_rows"])
    assert "sweep tiny: 2 rows (2 points run, 0 reused)" in printed.err
    assert main(["sweep", str(spec), "--out", str(out), "--json", "--select", "excess_risk"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen == json.loads((out / "selection.json").read_text()) and chosen["selected"]["epsilon"] in (1.0, 8.0)


def test_json_has_the_promised_fields_and_the_run_directory_is_complete(tmp_path, capsys):
    out = tmp_path / "run"
    r = run_json(capsys, *SMALL, "--out", str(out))
    for key in (
        "epsilon",
        "delta",
        "noise_multiplier",
        "subspace_error",
        "subspace_error_spectral",
        "excess_risk",
        "test_mse",
    ):
        assert isinstance(r[key], float), key
    assert (
        set(r["baselines"]) == {"nonprivate_altmin", "clipped_no_noise", "local_only", "oracle", "private_init_only"}
        and r["baselines_skipped"] == []
    )
    assert r["baselines"]["oracle"]["subspace_error"] < 1e-12
    assert r["test_mse"] == pytest.approx(r["excess_risk"] + 0.1**2)
    files = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "constants.json",
        "rounds.jsonl",
        "ledger.json",
        "result.json",
        "subspace_error.png",
    } <= files
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rounds] == [0, 1, 2]
    assert len(json.loads((out / "ledger.json").read_text())) == 5
    assert main(["privacy", str(out)]) == 0
    report = capsys.readouterr().out
    assert f"({r['epsilon']:.4g}, 1e-05)" in report and "paper's calibration" in report
    assert main(["privacy", str(out), "--quiet"]) == 0  # the (ε, δ) line alone, as in the full report
    quiet = capsys.readouterr().out.strip()
    assert "\n" not in quiet and quiet in report and f"({r['epsilon']:.4g}, 1e-05)" in quiet
    assert main(["run", "altmin", *SMALL, "--out", str(out)]) == 2  # an existing run is never overwritten


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--samples-per-user", "10"], "samples_per_user"),
        (["--rank", "6"], "rank"),
        (["--epsilon", "0"], "epsilon"),
        (["--epsilon", "nan"], "epsilon"),
        (["--delta", "1"], "delta"),
        (["--delta", "0"], "delta"),
        (["--n-users", "3", "--rounds", "5"], "n_users"),
        (["--n-users", "ten"], "n_users"),
        (["--cohorts", "disjoint", "--n-users", "1", "--rounds", "2"], "n_users"),
        (["--dtype", "float16"], "dtype"),
        (["--min-fraction", "0"], "min_fraction"),
        pytest.param(
            ["--device", "cuda"],
            "device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"),
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field(flags, field, capsys, tmp_path):
    assert main(["run", "altmin", *SMALL, *flags, "--out", str(tmp_path / "r")]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before any work


def _file_data(n=400, d=6, k=2, m=8):
    u = synthetic.subspace(3, d, k)
    users = synthetic.altmin_users(3, torch.arange(n), u, m + 4, 0.1)
    return u, users


def test_data_file_with_truth_gives_exact_metrics(tmp_path, capsys):
    u, users = _file_data()
    path = tmp_path / "d.npz"
    save_altmin_npz(path, x=users["x"][:, :8], y=users["y"][:, :8], u_star=u, v_star=users["v_star"])
    r = run_json(capsys, "--data", str(path), "--rank", "2", "--rounds", "2", "--out", str(tmp_path / "r"))
    assert "skipped_metrics" not in r and r["excess_risk"] > 0
    assert json.loads((tmp_path / "r" / "config.json").read_text())["data"] == str(path)


def test_data_file_without_truth_reports_heldout_mse_and_says_what_it_skipped(tmp_path, capsys):
    u, users = _file_data()
    path = tmp_path / "d.npz"
    save_altmin_npz(path, x=users["x"][:, :8], y=users["y"][:, :8], x_test=users["x"][:, 8:], y_test=users["y"][:, 8:])
    r = run_json(capsys, "--data", str(path), "--rank", "2", "--rounds", "2", "--out", str(tmp_path / "r"))
    assert set(r["skipped_metrics"]) == {"subspace_error", "excess_risk"}
    assert "subspace_error" not in r and 0 < r["test_mse"] < 10
    assert r["baselines"]["local_only"]["test_mse"] > 0


@pytest.mark.parametrize(
    "arrays, message",
    [
        (lambda x, y: {"x": x[:, :, :], "y": y[:, :5]}, "y must have shape"),
        (lambda x, y: {"x": x[:, :6], "y": y[:, :6], "x_test": x, "y_test": y}, "multiple of 4"),
        (lambda x, y: {"x": x[0], "y": y}, "x must have shape"),
        # a user's NaN sample is zeroed and counted; the file's declared truth is not a user's
        (lambda x, y: {"x": x, "y": y, "u_star": np.full((6, 2), np.nan)}, "u_star has 12 NaN/inf"),
        (lambda x, y: {"x": x, "y": y}, "nothing to measure"),
        (lambda x, y: {"x": x, "y": y, "u_star": np.zeros((6, 3)), "x_test": x, "y_test": y}, "u_star must have shape"),
    ],
)
def test_malformed_data_files_are_refused(arrays, message, tmp_path, capsys):
    _, users = _file_data()
    x, y = users["x"][:, :8].numpy(), users["y"][:, :8].numpy()
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays(x, y))
    assert main(["run", "altmin", "--data", str(path), "--rank", "2", "--out", str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err


def test_installed_console_script_runs_the_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fedpers", "run", "altmin", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "--n-users" in proc.stdout and "--runtime" in proc.stdout


def test_config_file_is_read_and_flags_override_it(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("n_users = 500\ndim = 6\nrank = 2\nsamples_per_user = 8\nrounds = 1\nepsilon = 1.0\n")
    r = run_json(capsys, "--config", str(cfg), "--epsilon", "3", "--out", str(tmp_path / "r"))
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["n_users"] == 500 and saved["epsilon"] == 3.0 and 0.9 * 3 <= r["epsilon"] <= 3
    cfg.write_text("n_userz = 5\n")
    assert main(["run", "altmin", "--config", str(cfg)]) == 2
    assert "n_userz" in capsys.readouterr().err


def test_a_failed_run_keeps_its_rounds_and_says_why(tmp_path, monkeypatch):
    from fedpers import config as config_lib
    from fedpers.experiments import EXPERIMENTS
    from fedpers.protocols.altmin import AltMinProtocol
    from fedpers.runner import execute

    original = AltMinProtocol.server_update

    def failing(self, round, state, summed, privatizer):
        if round == 2:
            raise RuntimeError("server lost power")
        return original(self, round, state, summed, privatizer)

    monkeypatch.setattr(AltMinProtocol, "server_update", failing)
    exp = EXPERIMENTS["altmin"]
    cfg = config_lib.build(exp.config_type, {"n_users": 400, "dim": 6, "samples_per_user": 8, "rounds": 3})
    with pytest.raises(RuntimeError, match="lost power"):
        execute(exp, cfg, out=tmp_path / "r", progress=False)
    error = json.loads((tmp_path / "r" / "error.json").read_text())
    assert error["rounds_completed"] == 2 and "lost power" in error["error"]
    assert len((tmp_path / "r" / "rounds.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "r" / "result.json").exists()
    assert len(json.loads((tmp_path / "r" / "ledger.json").read_text())) == 3  # init + round 1 (A, b)
