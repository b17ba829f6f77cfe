"""The local runtime on a GPU reads a round's checks once (with its summed message), not chunk by chunk,
and still never sums a non-finite contribution: a round where an assumption did not hold is made again
under the per-unit rule, with every check read as it comes (the per-chunk code: the same bits).

Under the fake CUDA device (tests/fake_cuda.py) a round of every device path costs
:data:`SYNCS_PER_ROUND` host syncs, whatever the number of chunks, and at most :data:`LAUNCHES_PER_CHUNK`
kernel launches per chunk of at most one generation block (1,024 users) plus :data:`LAUNCHES_PER_ROUND`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments import altmin as am
from fedpers.privacy import Privatizer
from fedpers.runtime.local import run_local
from tests.fake_cuda import fake_cuda, per_round

EXP = EXPERIMENTS["altmin"]
VALUES = dict(n_users=500, dim=4, rank=2, samples_per_user=8, cohorts="all", dtype="float32", calibration="paper")

SYNCS_PER_ROUND = 1
"""A round's host syncs on the device path: the one copy of its summed message and checks to the host."""
LAUNCHES_PER_CHUNK = 200
"""Kernel launches a chunk of up to 1,024 units may cost on any device path (benchmarks/device_syncs.py
measures 33 to 171 a chunk, docs/benchmarks.md)."""
LAUNCHES_PER_ROUND = 120
"""Launches a round may cost besides its chunks (the checks' flag, the copy of its sum)."""


def _units(bad: str) -> dict[str, torch.Tensor]:
    cfg = am.resolve(config.build(EXP.config_type, VALUES))
    units = am.load_units(cfg, torch.arange(cfg.n_users))
    units = {k: units[k] for k in ("ids", "x", "y")}
    if bad == "non-finite":
        units["x"][5, 6] = float("nan")  # round 0's half
        units["y"][300, 1] = float("inf")  # the rounds' half
    elif bad == "untrusted norms":  # finite, but beyond the range norms are trusted in: the exact rescaled path
        units["x"][7, 1] = 1e30
        units["x"][420, 5] = 1e-30
        units["x"][421, 2] = 0.0 * units["x"][421, 2]
    return units


@pytest.mark.parametrize("bad", ["none", "non-finite", "untrusted norms"])
def test_deferred_checks_sum_what_the_per_chunk_checks_sum(bad):
    """A planted bad unit: with the checks deferred, the run is the per-chunk run bit for bit (its U,
    every round's diagnostics, the units counted and zeroed)."""
    proto = am.make_protocol(am.resolve(config.build(EXP.config_type, VALUES)))
    out = {}
    for defer in (False, True):
        state, records = run_local(
            proto, _units(bad), Privatizer(3), chunk_size=128, progress=False, defer_checks=defer
        )
        out[defer] = (state["U"], [(r.units, r.zeroed, r.diagnostics) for r in records])
    assert torch.equal(out[False][0], out[True][0]) and out[False][1] == out[True][1]
    assert [z for _, z, _ in out[True][1]] == ([1, 1, 1] if bad == "non-finite" else [0, 0, 0])


@pytest.mark.parametrize("bad", ["non-finite", "untrusted norms"])
def test_a_cuda_round_with_a_bad_unit_is_the_per_chunk_round(bad):
    """Under the fake device the deferred round falls back to the per-chunk checks: the same
    releases (to float rounding: the device branches sum in one stream) and the same units zeroed."""
    proto = am.make_protocol(am.resolve(config.build(EXP.config_type, VALUES)))
    host, host_records = run_local(
        proto, _units(bad), Privatizer(3), chunk_size=256, progress=False, defer_checks=False
    )
    with fake_cuda():
        units = {k: v.to("cuda") for k, v in _units(bad).items()}
        dev, dev_records = run_local(proto, units, Privatizer(3), chunk_size=256, progress=False)
    torch.testing.assert_close(dev["U"], host["U"], rtol=1e-4, atol=1e-5)
    assert [(r.units, r.zeroed) for r in dev_records] == [(r.units, r.zeroed) for r in host_records]


def _config(name: str, values: dict[str, Any]) -> Any:
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, {**values, "device": "cuda"})
    return exp, cfg


SMALL = {"dim": 6, "rank": 2, "samples_per_user": 8}
DEVICE_PATHS = {
    "altmin": ("altmin", {"n_users": 2100, **SMALL, "dtype": "float32"}),
    "altmin poisson": (
        "altmin",
        {"n_users": 2100, **SMALL, "dtype": "float32", "cohorts": "poisson", "sampling_rate": 0.5, "epsilon": "inf"},
    ),
    "altmin adaptive, every user every round, float64": (
        "altmin",
        {"n_users": 1100, **SMALL, "cohorts": "all", "clip_rule": "adaptive"},
    ),
    "fedrep": ("fedrep", {"n_users": 1100, **SMALL, "rounds": 2, "dtype": "float32"}),
    "fedrep poisson": (
        "fedrep",
        {
            "n_users": 1100,
            **SMALL,
            "rounds": 2,
            "dtype": "float32",
            "cohorts": "poisson",
            "sampling_rate": 0.5,
            "epsilon": "inf",
        },
    ),
    "fedrep poisson, banded (amplified: a block of ids a round, sampled)": (
        "fedrep",
        {
            "n_users": 1100,
            **SMALL,
            "rounds": 4,
            "dtype": "float32",
            "cohorts": "poisson",
            "sampling_rate": 0.25,
            "noise": "banded",
            "bands": 2,
            "epsilon": 4.0,
        },
    ),
    "noisygd pca": ("noisygd", {"examples": 1100, "feature_dim": 20, "steps": 2, "epsilon": 0.5, "remedy": "pca"}),
    "noisygd cyclic, adaptive": (
        "noisygd",
        {
            "examples": 1100,
            "feature_dim": 20,
            "steps": 3,
            "remedy": "center",
            "cycle": 3,
            "cohorts": "cyclic",
            "clip_rule": "adaptive",
        },
    ),
    "noisygd poisson": (
        "noisygd",
        {
            "examples": 1100,
            "feature_dim": 20,
            "steps": 2,
            "remedy": "center",
            "cohorts": "poisson",
            "sampling_rate": 0.5,
        },
    ),
    "noisygd poisson, banded (amplified)": (
        "noisygd",
        {
            "examples": 1100,
            "feature_dim": 20,
            "steps": 4,
            "remedy": "center",
            "cohorts": "poisson",
            "sampling_rate": 0.25,
            "noise": "banded",
            "bands": 2,
        },
    ),
    "dpals": (
        "dpals",
        {"n_users": 300, "n_items": 25, "rank": 3, "true_rank": 3, "steps": 2, "head_items": 20, "dtype": "float32"},
    ),
    "noisyhead statistics": ("noisyhead", {"prompts": 400, "dim": 3}),
    "noisyhead rounds": ("noisyhead", {"prompts": 400, "dim": 3, "mode": "rounds", "steps": 3}),
    "noisyhead rounds, poisson, banded (amplified)": (
        "noisyhead",
        {"prompts": 400, "dim": 3, "mode": "rounds", "steps": 4, "sampling_rate": 0.25, "noise": "banded", "bands": 2},
    ),
    "expmech": ("expmech", {"n_users": 1100, "dim": 3, "rank": 1}),
}


@pytest.mark.parametrize("path", sorted(DEVICE_PATHS))
def test_a_device_round_syncs_once_and_launches_a_bounded_number_of_kernels_per_chunk(path):
    """Every round of every device path: the same host syncs for few and for many chunks (one: its
    summed message and checks, copied together), at most a bounded number of launches per chunk."""
    name, values = DEVICE_PATHS[path]
    for chunk in (1024, 300):
        rounds = per_round(name, values, chunk)
        assert rounds, path
        for syncs, launches, chunks in rounds:
            assert syncs == SYNCS_PER_ROUND <= 3, (path, chunk, rounds)
            assert launches <= LAUNCHES_PER_CHUNK * chunks + LAUNCHES_PER_ROUND, (path, chunk, rounds)
