"""Nothing spent for nothing: bad input is refused before any work, naming the field."""

from __future__ import annotations

import math
import zipfile

import numpy as np
import pytest

from fedpers import config
from fedpers.data.files import load_altmin_npz, save_altmin_npz
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import AltMinConfig, make_protocol
from fedpers.privacy.accountant import analytic_gaussian_epsilon


@pytest.mark.parametrize(
    "values, match",
    [
        ({"n_users": True}, "n_users must be of type int"),
        ({"epsilon": 300.0}, r"epsilon must be > 0.0 and <= 100.0, or inf"),
        ({"clip_model": math.inf}, "clip_model must be finite"),
        ({"noise_std": math.inf}, "noise_std must be finite"),
        ({"epsilon": -math.inf}, "epsilon must be finite"),
        ({"delta": False}, "delta must be of type float"),
    ],
)
def test_bad_config_values_are_refused_naming_the_field(values, match):
    with pytest.raises(ValueError, match=match):
        config.build(AltMinConfig, values)


def test_every_algorithm_refuses_an_infinite_non_epsilon_field():
    for name, exp in EXPERIMENTS.items():
        floats = [f for f, t in config.field_types(exp.config_type).items() if t is float and f != "epsilon"]
        for field in floats:
            with pytest.raises(ValueError, match=f"{field} must be finite"):
                config.build(exp.config_type, {field: math.inf})


def test_epsilon_inf_still_means_no_noise():
    assert make_protocol(config.build(AltMinConfig, {"epsilon": "inf", "n_users": 100})).noise_multiplier == 0.0


def test_analytic_gaussian_handles_large_epsilon_without_overflow():
    assert analytic_gaussian_epsilon(60.0, 1e-5) > 700  # e^ε alone overflows past 709


def _write(path, **arrays):
    save_altmin_npz(path, **arrays)
    return path


def _users(n=6, m=4, d=3, k=2):
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((d, k)))
    return dict(x=rng.standard_normal((n, m, d)), y=rng.standard_normal((n, m)), u_star=u)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "x": a["x"] + 1j}, "x is complex-valued"),
        (lambda a: {**a, "u_star": 2 * a["u_star"]}, "orthonormal"),
        (lambda a: {**a, "x_test": np.zeros((6, 0, 3)), "y_test": np.zeros((6, 0))}, "t >= 1"),
        (lambda a: {**a, "weights": np.zeros(3)}, "unknown array 'weights'"),
        (lambda a: {**a, "x": a["x"].astype(object)}, "numeric"),
    ],
)
def test_bad_data_files_are_refused(tmp_path, change, match):
    path = _write(tmp_path / "d.npz", **change(_users()))
    with pytest.raises(ValueError, match=match):
        load_altmin_npz(path, 2)


def test_an_unknown_huge_member_is_refused_from_the_member_list(tmp_path, monkeypatch):
    """A ~1 MB file whose unknown member inflates to 512 MiB: refused without inflating it."""
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, **_users())
    header = np.lib.format.header_data_from_array_1_0(np.zeros(0))
    header["shape"] = (2**26,)
    with (
        zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as z,
        z.open("payload.npy", "w", force_zip64=True) as f,
    ):
        np.lib.format.write_array_header_1_0(f, header)
        block = bytes(2**24)
        for _ in range(2**29 // 2**24):
            f.write(block)
    assert path.stat().st_size < 10 * 2**20
    inflated = [0]  # bytes inflated from any member: counted, not timed, so a loaded machine cannot fail it
    read1 = zipfile.ZipExtFile._read1

    def counted(self: zipfile.ZipExtFile, n: int) -> bytes:
        data = read1(self, n)
        inflated[0] += len(data)
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "_read1", counted)
    with pytest.raises(ValueError, match="unknown array 'payload'"):
        load_altmin_npz(path, 2)
    assert inflated[0] < 2**20  # the .npy headers of the known members; inflating the payload is 2^29


def test_a_run_that_cannot_fit_is_refused_before_any_work(monkeypatch):
    from fedpers import memory
    from fedpers.experiments.altmin import plan

    # a machine of 16 GiB free, declared: on a host with more than these runs need (51 GiB to petabytes) they
    # would fit, and the test would fail there every time
    monkeypatch.setattr(memory, "available_bytes", lambda: 16 * 2**30)

    def no_calibration(*args, **kwargs):  # the work a refusal must come before (1.4 s a run, loaded machine)
        raise AssertionError("calibrated the noise before refusing the run")

    monkeypatch.setattr(plan, "calibrate_noise_multiplier", no_calibration)
    with pytest.raises(ValueError, match=r"altmin needs about .* of memory \(data .*, baselines .*\)"):
        make_protocol(config.build(AltMinConfig, {"n_users": 10**6, "dim": 5000, "rank": 2}))
    for name, values in {
        "noisyhead": {"prompts": 10**8},
        "noisygd": {"examples": 10**8, "feature_dim": 1000},
        "dpattention": {"columns": 10**10},
    }.items():
        exp = EXPERIMENTS[name]
        with pytest.raises(ValueError, match=f"{name} needs about"):
            exp.protocol(config.build(exp.config_type, values))


@pytest.mark.parametrize("accountant, delta", [("pld", 1e-20), ("pld", 4e-16), ("rdp", 1e-20)])
def test_a_delta_the_accountant_cannot_resolve_is_refused_not_solved_forever(accountant, delta):
    """dp-accounting's PLD holds ~5e-16 of mass at infinity at any noise: a smaller δ has ε = inf
    for every z, and calibration used to raise z forever (`fedpers run altmin --delta 1e-20` hung)."""
    import dp_accounting

    from fedpers.privacy.accountant import calibrate_noise_multiplier

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 3)

    if accountant == "pld":
        with pytest.raises(ValueError, match=r"delta must be >= 1e-15 with the pld accountant.*got"):
            calibrate_noise_multiplier(event, 4.0, delta, accountant)
    else:  # RDP resolves any δ > 0: the same target is solved
        assert 0 < calibrate_noise_multiplier(event, 4.0, delta, accountant) < 20


@pytest.mark.parametrize(
    "out, match",
    [
        ("a_file", r"^out: cannot create the run directory .*a file is in the way"),
        ("a_file/run", r"^out: cannot create the run directory .*a file is in the way"),
        ("a_sweep", r"^out: .*a_sweep holds a sweep \(spec.json\), not a run"),
    ],
)
def test_an_out_path_blocked_by_a_file_or_a_sweep_is_refused_naming_out(tmp_path, out, match):
    """`--out FILE` (or a path under a file) used to end in a FileExistsError / NotADirectoryError
    traceback; `--out SWEEP_DIR` overwrote the sweep's provenance.json and figures."""
    from fedpers.results.rundir import RunDirectory

    (tmp_path / "a_file").write_text("mine\n")
    (tmp_path / "a_sweep").mkdir()
    (tmp_path / "a_sweep" / "spec.json").write_text("{}\n")
    with pytest.raises(ValueError, match=match):
        RunDirectory(tmp_path / out)
    assert (tmp_path / "a_file").read_text() == "mine\n"
    assert sorted(p.name for p in (tmp_path / "a_sweep").iterdir()) == ["spec.json"]


@pytest.mark.parametrize(
    "command, out, match",
    [
        ("report", "missing/r.html", "--out: the folder .*missing does not exist"),
        ("report", "a_dir", "--out: .*a_dir is a directory"),
        ("compare", "missing/c.png", "--out: the folder .*missing does not exist"),
    ],
)
def test_an_output_file_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, command, out, match):
    """`fedpers report/compare --out` into a missing folder or onto a directory ended in a traceback
    (after the work; report left a `.NAME.tmp` behind)."""
    import re

    from fedpers.commands.cli import main

    (tmp_path / "a_dir").mkdir()
    assert main([command, str(tmp_path / "some_run"), "--out", str(tmp_path / out)]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_write_atomic_leaves_no_temporary_file_when_it_fails(tmp_path):
    from fedpers.results.rundir import write_atomic

    (tmp_path / "a_dir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path / "a_dir", "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir"]


def test_a_misspelt_config_file_key_is_named_as_such(tmp_path, capsys):
    """A typo in `--config FILE` was reported as "unknown RuntimeOptions field(s): epsilonn; known:
    bits, ..." (the runtime's fields only, where `epsilon` is not)."""
    from fedpers.commands.cli import main

    path = tmp_path / "c.toml"
    path.write_text("n_users = 200\nepsilonn = 2.0\n")
    assert main(["run", "altmin", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"config: {path}: unknown key(s) epsilonn (did you mean epsilon?)" in err and "RuntimeOptions" not in err
    assert not (tmp_path / "run").exists()


def test_an_empty_poisson_cohort_is_released_as_noise_not_a_failed_round():
    """With Poisson cohorts a round may sample no user ((1 - q)^n; 13 % per round at q = 0.01,
    n = 200): the local runtime had no message and failed the run after round 0's release
    ("0 of 1 clients answered acceptably"). The zero sum is released with its noise instead."""
    from fedpers.experiments import experiment
    from fedpers.runner import execute

    exp = experiment("altmin")
    cfg = config.build(
        exp.config_type,
        {"n_users": 40, "dim": 4, "rank": 2, "cohorts": "poisson", "sampling_rate": 1e-9, "baselines": "none"},
    )
    result = execute(exp, cfg, write=False, progress=False)
    rounds = result["_rounds"]
    assert [r["units"] for r in rounds[1:]] == [0, 0] and math.isfinite(result["epsilon"])


@pytest.mark.parametrize(
    "out, hosts, match",
    [
        ("certs", [""], r"host must be a name or IP address of 1 to 64 characters, no spaces; got ''"),
        ("certs", ["a", "b c"], r"host must be .*; got 'b c'"),
        ("a_file", ["a"], r"dir: .*a_file is a file, not a directory"),
    ],
)
def test_deploy_certs_refuses_a_bad_host_or_a_file_as_its_directory(tmp_path, out, hosts, match):
    """`deploy certs DIR --host ''` failed inside cryptography ("Attribute's length must be >= 1");
    `deploy certs FILE` ended in a NotADirectoryError traceback."""
    from fedpers.deploy import make_certs

    (tmp_path / "a_file").write_text("mine\n")
    with pytest.raises(ValueError, match=match):
        make_certs(tmp_path / out, hosts, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_an_epsilon_below_the_accountants_grid_is_refused_not_solved_for_minutes():
    """DPALS at ε = 1e-4: PLD's ε stays above the target at any nearby noise (its discretisation
    is coarser), and calibration raised z by 1e-4 per step for minutes (`fedpers run dpals
    --n-users 200 --epsilon 1e-4` ran > 2 min; noisygd alike)."""
    from fedpers.experiments import experiment
    from fedpers.privacy import Calibrations

    exp = experiment("dpals")
    cfg = config.build(exp.config_type, {"n_users": 200, "epsilon": 1e-4})
    with pytest.raises(
        ValueError, match=r"epsilon 0.0001 is below what the pld accountant resolves .*--accountant rdp"
    ):
        exp.protocol(cfg, Calibrations())


def test_a_tiny_epsilon_is_an_error_or_a_vacuous_bound_not_a_zero_division():
    """ε = 1e-100 made DPCovariance's default k divide by t² = 0 (before any release, a traceback);
    ε = 1e-300 made NoisyHead's Theorem 4.1 bound divide by (Nε)² = 0 after every release."""
    from fedpers.experiments import experiment
    from fedpers.privacy.mechanisms import dp_covariance_min_k
    from fedpers.runner import execute

    with pytest.raises(ValueError, match=r"epsilon 1e-100 is too small for DPCovariance's default k"):
        dp_covariance_min_k(4, 1e-100, 0.1)
    exp = experiment("noisyhead")
    cfg = config.build(exp.config_type, {"prompts": 40, "steps": 1, "epsilon": 1e-300})
    assert execute(exp, cfg, write=False, progress=False)["theorem41_bound"] == math.inf


@pytest.mark.parametrize(
    "out, match",
    [
        ("a_file", r"out: cannot create the directory .*a_file: a file is in the way"),
        ("a_file/sweep", r"out: cannot create the directory .*a_file/sweep: a file is in the way"),
        ("a_run", r"out: .*a_run holds a run \(config.json\), not a sweep"),
    ],
)
def test_a_sweep_out_that_is_a_file_or_a_run_is_refused(tmp_path, out, match):
    """`fedpers sweep S --out FILE` ended in a FileExistsError traceback, and a sweep into a run's
    directory wrote its table and points among the run's files."""
    from fedpers.results.rundir import SweepDirectory

    (tmp_path / "a_file").write_text("mine\n")
    (tmp_path / "a_run").mkdir()
    (tmp_path / "a_run" / "config.json").write_text("{}\n")
    with pytest.raises(ValueError, match=match):
        SweepDirectory(tmp_path / out, {"sweep": 1}, {})
    assert sorted(p.name for p in (tmp_path / "a_run").iterdir()) == ["config.json"]


def test_a_rating_scale_of_one_value_is_refused():
    """`--rating-min 3 --rating-max 3` ran: every kept rating equal, private test RMSE 58.6 against
    the user-mean baseline's 0 (a warning, exit 0)."""
    from fedpers.experiments.dpals import DpAlsConfig

    with pytest.raises(ValueError, match=r"rating_min must be < rating_max \(3\); got 3"):
        config.build(DpAlsConfig, {"ratings": "r.csv", "item_ids": "0:9", "rating_min": 3.0, "rating_max": 3.0})


def test_one_column_in_two_roles_of_a_rating_file_is_refused():
    """`--rating-column user` read the user ids as ratings and ran (nonsense, exit 0)."""
    from fedpers.experiments.dpals import DpAlsConfig

    base = {"ratings": "r.csv", "item_ids": "0:9", "rating_min": 1.0, "rating_max": 5.0}
    for role in ({"rating_column": "user"}, {"item_column": "rating"}):
        with pytest.raises(ValueError, match="must name three different columns"):
            config.build(DpAlsConfig, {**base, **role})


@pytest.mark.parametrize("argv", [["run", "altmin", "--out", ""], ["sweep", "s.toml", "--out", ""]])
def test_an_empty_out_is_refused_not_the_current_directory(tmp_path, monkeypatch, capsys, argv):
    """`--out ""` (an unset shell variable) was Path("") = ".": the run's files landed in the cwd."""
    from fedpers.commands.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2 and "argument --out: an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
