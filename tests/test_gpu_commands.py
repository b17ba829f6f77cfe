"""The README's GPU commands run on the fake CUDA device (tests/fake_cuda.py) at small sizes: the same code
a GPU runs, failing where a GPU would, and reading the device no more often than it should."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import altmin_run, device_syncs, dpals_step
from tests.fake_cuda import fake_cuda


def _main(module, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()


def test_altmin_run_benchmark_on_cuda(monkeypatch, capsys):
    """``benchmarks/altmin_run.py --device cuda``: the run, the GEMM and the draw on the device; a round
    reads it once, so the whole run's syncs do not grow with its chunks."""
    argv = ["--users", "4096", "--dim", "8", "--rank", "2", "--samples", "16", "--device", "cuda", "--malloc", "system"]
    with fake_cuda() as fc:
        _main(altmin_run, argv, monkeypatch)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["device"] == "cuda" and report["device_name"] == "fake" and report["users_per_s"] > 0
    assert report["passes"] == pytest.approx(1.5)  # init + evaluation pass halves, each cohort's other half once
    assert fc.traffic.syncs < 40  # two runs (n, n/4), each: 3 rounds and one evaluation pass, one read each and set-up


def test_dpals_step_benchmark_on_cuda(monkeypatch, capsys):
    argv = ["--users", "600", "--items", "80", "--ratings", "12000", "--rank", "4", "--width", "60", "--chunk", "128"]
    with fake_cuda() as fc:
        _main(dpals_step, [*argv, "--device", "cuda", "--malloc", "system"], monkeypatch)
    out = capsys.readouterr().out
    assert "device=cuda kernels=device" in out and "whole step" in out
    made = fc.traffic.sync_sites()
    made.pop("(outside fedpers)", None)  # the benchmark's own copies of the data, before the clock starts
    assert sum(made.values()) == 1  # the statistics of 5 chunks read once, the server on the host


def test_device_syncs_benchmark_counts_one_sync_a_round(monkeypatch):
    """benchmarks/device_syncs.py measures what tests/test_deferred_checks.py asserts (its own fake device)."""
    monkeypatch.setitem(
        device_syncs.PATHS,
        "tiny",
        ("altmin", {"n_users": 2100, "dim": 4, "rank": 2, "samples_per_user": 8, "dtype": "float32"}),
    )
    rounds = device_syncs.per_round("altmin", device_syncs.PATHS["tiny"][1], 300)
    assert [r[0] for r in rounds] == [1, 1, 1] and all(r[2] >= 2 for r in rounds)
