"""Every device code path run as ``--device cuda`` under the fake CUDA device (tests/fake_cuda.py).

A device tensor meeting a host tensor, a generator on the wrong device or ``.numpy()`` of a device
tensor fails here as it would on a GPU. Where docs/device-kernels.md and docs/benchmarks.md ("What a
CPU run and a GPU run of one seed share") promise that ``--kernels device --device cpu`` is the GPU
code on CPU tensors, the fake run of a seed equals that run: the fake's "cuda" generators draw the
CPU's stream (a GPU draws Philox), and the code's GPU branches (one stream instead of thread shares)
change float sums only in their last bits.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from fedpers import config
from fedpers.commands.cli import main
from fedpers.data import synthetic
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import plan as altmin_plan
from fedpers.experiments.noisyhead import montecarlo as mc
from fedpers.experiments.noisyhead import sweep
from fedpers.runner import execute
from tests.fake_cuda import fake_cuda

TOL = {"float64": 1e-9, "float32": 1e-4}


def _run(name: str, values: dict[str, Any]) -> dict[str, Any]:
    exp = EXPERIMENTS[name]
    return execute(exp, config.build(exp.config_type, values), write=False, progress=False)


def _both(name: str, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``--kernels device --device cpu`` run, ``--device cuda`` run under the fake) of one config."""
    host_side = _run(name, {**values, "device": "cpu", "kernels": "device"})
    with fake_cuda():
        on_gpu = _run(name, {**values, "device": "cuda"})
    return host_side, on_gpu


def _numbers(result: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in result.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds":
            out[prefix + k] = float(v)
    return out


def _assert_same(expected: dict[str, Any], got: dict[str, Any], rel: float) -> None:
    a, b = _numbers(expected), _numbers(got)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=rel, abs=1e-12), k


ALTMIN = {
    "n_users": 3000,
    "dim": 10,
    "rank": 2,
    "samples_per_user": 16,
    "rounds": 2,
    "epsilon": 8.0,
    "chunk_size": 1000,
}


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(
            {"dtype": "float64", "baselines": "oracle"}, marks=pytest.mark.slow
        ),  # the cases below cover both dtypes
        {"dtype": "float32", "baselines": "oracle"},
        {"dtype": "float32", "baselines": "oracle", "cohorts": "poisson", "sampling_rate": 0.5, "epsilon": math.inf},
        {"dtype": "float64", "baselines": "oracle", "cohorts": "all", "refit_samples": 4, "test_samples": 8},
        pytest.param(
            {"dtype": "float32", "baselines": "none", "cohorts": "poisson", "sampling_rate": 0.5},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_altmin_on_cuda_is_the_cpu_device_path(extra):
    """Users, statistics, solves and evaluation on the device; Poisson memberships broadcast from the server."""
    host_side, on_gpu = _both("altmin", {**ALTMIN, **extra})
    assert "baselines_error" not in on_gpu and on_gpu["subspace_error"] < 1
    _assert_same(host_side, on_gpu, TOL[extra["dtype"]])


def test_fedpers_run_altmin_device_cuda_with_every_baseline(tmp_path, capsys):
    """The CLI's default baselines (all) on cuda: each is computed on the device, none drops out."""
    flags = ["--n-users", "3000", "--dim", "10", "--rank", "2", "--dtype", "float32", "--chunk-size", "1000"]
    assert main(["run", "altmin", *flags, "--kernels", "device", "--out", str(tmp_path / "cpu")]) in (0, None)
    with fake_cuda() as fc:
        assert main(["run", "altmin", *flags, "--device", "cuda", "--out", str(tmp_path / "cuda")]) in (0, None)
    capsys.readouterr()
    host_side, on_gpu = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("cpu", "cuda"))
    assert "baselines_error" not in on_gpu and on_gpu["baselines_skipped"] == []
    _assert_same(host_side, on_gpu, 1e-4)
    assert fc.traffic.h2d and fc.traffic.syncs  # the run's copies and syncs are counted (see test below)


def test_altmin_chunks_draw_users_on_the_device_and_copy_only_bookkeeping():
    """Per chunk, the host sends the chunk's ids (and U*, the index of a partly asked-for block) and
    reads nothing back (the block grouping is made on the host's copy of the ids): a few bytes per
    user, never the users' samples (drawn on the device)."""
    per_chunk = {}
    for chunk in (1500, 500):
        with fake_cuda() as fc:
            _run("altmin", {**ALTMIN, "dtype": "float32", "baselines": "none", "chunk_size": chunk, "device": "cuda"})
        per_chunk[chunk] = fc.traffic
    few, many = per_chunk[1500], per_chunk[500]
    sample_bytes = ALTMIN["n_users"] * ALTMIN["samples_per_user"] * (ALTMIN["dim"] + 1) * 4  # one pass, float32
    assert many.h2d > few.h2d and many.d2h == few.d2h  # per-chunk copies to the device (bookkeeping), none back ...
    assert many.h2d_bytes + many.d2h_bytes < sample_bytes / 10  # ... and they are small
    assert many.d2h_bytes < 16 * ALTMIN["n_users"]


@pytest.mark.parametrize("extra", [{}, {"mode": "rounds"}, {"unit": "user", "prompts_per_user": 4, "user_clip": 0.5}])
def test_noisyhead_on_cuda_is_the_cpu_device_path(extra):
    _assert_same(*_both("noisyhead", {"prompts": 400, "dim": 3, "epsilon": 1.0, **extra}), 1e-9)


@pytest.mark.parametrize("engine", ["direct", "spectral"])
def test_noisyhead_monte_carlo_sweep_on_cuda_is_the_cpu_device_path(engine):
    cfg = config.build(
        EXPERIMENTS["noisyhead"].config_type,
        {"prompts": 300, "dim": 3, "epsilon": 0.5, "engine": engine, "init": "gaussian", "attack_c": 1.0},
    )
    mc._CACHE.clear()
    host_side = sweep.sweep_point(replace(cfg, kernels="device"), 16)
    mc._CACHE.clear()
    try:
        with fake_cuda():
            on_gpu = sweep.sweep_point(replace(cfg, device="cuda"), 16)
    finally:
        mc._CACHE.clear()
    assert len(on_gpu) == len(host_side) == 16
    for a, b in zip(host_side, on_gpu):
        _assert_same(a, b, 1e-9)


@pytest.mark.parametrize(
    "extra",
    [
        {"collapse": "random", "remedy": "pca"},
        {"collapse": "offset", "remedy": "center", "dtype": "float64", "imbalance": 0.3},
    ],
)
def test_noisygd_on_cuda_is_the_cpu_device_path(extra):
    values = {"examples": 1500, "feature_dim": 40, "steps": 4, "epsilon": 0.5, "test_perturbation": 0.3, **extra}
    _assert_same(*_both("noisygd", values), 1e-9)


FEDREP = {"n_users": 2000, "dim": 10, "rank": 2, "rounds": 3, "baselines": "none"}


def test_fedrep_on_cuda_in_float32_is_the_cpu_device_path():
    _assert_same(*_both("fedrep", {**FEDREP, "dtype": "float32", "chunk_size": 700}), 1e-4)


def test_fedrep_on_cuda_in_float64_draws_the_device_scheme_users(monkeypatch):
    """float64 on a GPU draws users per (block, part) (docs/device-kernels.md), not the CPU's float64
    users: with the CPU run made to draw that scheme too, the runs agree."""
    with fake_cuda():
        on_gpu = _run("fedrep", {**FEDREP, "device": "cuda"})
    monkeypatch.setattr(synthetic, "uses_parts_scheme", lambda dtype, device="cpu": True)
    host_side = _run("fedrep", {**FEDREP, "device": "cpu", "kernels": "device"})
    _assert_same(host_side, on_gpu, 1e-9)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dpals_on_cuda_is_the_cpu_device_path(dtype):
    values = {"n_users": 300, "n_items": 25, "rank": 3, "true_rank": 3, "steps": 2, "epsilon": 4.0, "head_items": 20}
    _assert_same(*_both("dpals", {**values, "seed": 3, "dtype": dtype, "chunk_size": 150}), TOL[dtype])


def test_expmech_on_cuda_scores_and_evaluates_on_the_device(monkeypatch):
    """``run expmech`` has no --kernels: on cuda its users come from AltMin's device path, which the
    CPU reference is made to take."""
    values = {"n_users": 2000, "dim": 3, "rank": 1}
    with fake_cuda():
        on_gpu = _run("expmech", {**values, "device": "cuda"})
    monkeypatch.setattr(altmin_plan, "device_path", lambda device, kernels="auto": True)  # where the plan reads it
    _assert_same(_run("expmech", values), on_gpu, 1e-9)


def test_a_cuda_run_resumes_with_its_server_state_on_the_host(tmp_path, monkeypatch):
    """A checkpoint is read onto the run's device; the local runtime's server keeps its state on the
    host, so a resumed GPU run moves it back before its next server step (FedRep's step reads U)."""
    from fedpers.runner import resume_run
    from fedpers.runtime import checkpoint

    values = {**FEDREP, "dtype": "float32", "chunk_size": 700, "device": "cuda"}
    exp = EXPERIMENTS["fedrep"]
    with fake_cuda():
        whole = execute(exp, config.build(exp.config_type, values), out=tmp_path / "whole", progress=False)
    real, saves = checkpoint.Checkpointer.save, [0]

    def stops_after_two(self, ckpt):
        real(self, ckpt)
        saves[0] += 1
        if saves[0] == 2:
            raise KeyboardInterrupt  # killed after round 1's checkpoint

    monkeypatch.setattr(checkpoint.Checkpointer, "save", stops_after_two)
    with fake_cuda(), pytest.raises(KeyboardInterrupt):
        execute(exp, config.build(exp.config_type, values), out=tmp_path / "cut", progress=False)
    monkeypatch.setattr(checkpoint.Checkpointer, "save", real)
    with fake_cuda():
        resumed = resume_run(tmp_path / "cut", progress=False)
    _assert_same(whole, resumed, 1e-6)
