"""AltMin's device path (``--kernels device``) run on CPU tensors, against the host path."""

from __future__ import annotations

import pytest
import torch

from fedpers import config, linalg
from fedpers.data import synthetic
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import AltMinConfig, load_units, make_protocol
from fedpers.runner import execute
from tests.synthetic_support import forbid_host_generation

SHAPE = dict(
    n_users=5000, dim=12, rank=3, samples_per_user=16, rounds=2, epsilon=8.0, baselines="oracle", chunk_size=1500
)


def _run(**values):
    exp = EXPERIMENTS["altmin"]
    return execute(exp, config.build(exp.config_type, {**SHAPE, **values}), write=False, progress=False)


def test_device_kernels_on_cpu_give_the_host_result_for_float32():
    """Same users (float32 draws per (block, part) on both paths), same noise: the results agree
    to float32 rounding (only the summation order of the statistics differs)."""
    host = _run(dtype="float32", kernels="host")
    device = _run(dtype="float32", kernels="device")
    for key in ("subspace_error", "excess_risk"):
        assert device[key] == pytest.approx(host[key], rel=2e-3), key
    assert device["baselines"]["oracle"]["excess_risk"] == pytest.approx(
        host["baselines"]["oracle"]["excess_risk"], rel=1e-4
    )


def test_device_statistics_equal_the_host_statistics():
    cfg = config.build(AltMinConfig, {**SHAPE, "dtype": "float32"})
    units = load_units(cfg, torch.arange(3000))
    U = synthetic.subspace(1, cfg.dim, cfg.rank, torch.float32)
    host = make_protocol(cfg)
    device = make_protocol(config.build(AltMinConfig, {**SHAPE, "dtype": "float32", "kernels": "device"}))
    assert device.device_kernels and not host.device_kernels
    for a, b in zip(
        host.round_statistics(U, units["x"], units["y"]), device.round_statistics(U, units["x"], units["y"])
    ):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(
        device.init_statistic(units["x"], units["y"]), host.init_statistic(units["x"], units["y"]), rtol=1e-4, atol=1e-3
    )


def test_device_kernels_take_a_few_large_blocks(monkeypatch):
    """No Python loop over 48-user blocks on the device path: a 4,096-user chunk is 2 batched Grams."""
    calls = []
    real = torch.bmm

    def bmm(a, b, *args, **kwargs):
        calls.append(a.shape[0])
        return real(a, b, *args, **kwargs)

    x = torch.randn(4096, 5, 8)
    v = torch.randn(4096, 3)
    monkeypatch.setattr(torch, "bmm", bmm)
    linalg.kron_statistics(v, x, v.norm(dim=-1).double().log(), 2.0, label=torch.randn(4096, 5), device_kernels=True)
    assert max(calls) == linalg.DEVICE_BLOCK and len(calls) <= 2 * -(-4096 // linalg.DEVICE_BLOCK)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_device_path_never_calls_the_host_generator(monkeypatch, dtype):
    """With --kernels device every user is drawn from generators on the run's device keyed by
    (seed, block, part), in any dtype: the float64 host blocks are never made."""

    devices = forbid_host_generation(monkeypatch)
    result = _run(dtype=dtype, kernels="device", n_users=2500, baselines="none")
    assert result["subspace_error"] < 1 and devices and all(d.type == "cpu" for d in devices)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float64, marks=pytest.mark.slow)])
def test_device_drawn_users_are_the_same_for_any_chunking_and_order(dtype):
    u = synthetic.subspace(0, 7, 2)
    whole = synthetic.altmin_users(9, torch.arange(3000), u, 12, 0.1, dtype, parts=True)
    order = torch.randperm(3000, generator=torch.Generator().manual_seed(1))
    for chunk in (1, 700, 1024, 3000):
        for start in range(0, 3000, chunk):
            ids = order[start : start + chunk]
            part = synthetic.altmin_users(9, ids, u, 12, 0.1, dtype, parts=True, halves=(1,), compact=True)
            assert torch.equal(part["x"], whole["x"][ids, 6:]) and torch.equal(part["y"], whole["y"][ids, 6:]), chunk
            assert torch.equal(part["v_star"], whole["v_star"][ids]), chunk
