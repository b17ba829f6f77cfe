"""`python -m benchmarks` at its quick size: every row measured, a finite ratio each, the dated table written."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_benchmark_command_prints_every_ratio_and_writes_the_table(tmp_path):
    table = tmp_path / "table.md"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--table", str(table)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    ).stdout
    rows = [line for line in table.read_text().splitlines() if line.startswith("| ") and "**" in line]
    names = [r.split("|")[1].strip() for r in rows]
    assert names == [
        "AltMin: every baseline / --baselines none",
        "AltMin run / floor",
        "client statistics / GEMM (float32)",
        "client statistics / GEMM (float64)",
        "DPALS step / GEMM",
        "start-up: wall / reported work",
    ]
    for r in rows:
        ratio = float(r.split("**")[1].rstrip("×"))
        assert math.isfinite(ratio) and ratio > 0, r
    assert table.read_text().startswith("# Benchmark table · 20") and "written:" in out
