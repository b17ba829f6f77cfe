"""The docs' sample outputs are what the code prints now (docs/samples.py regenerates them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def samples():
    spec = importlib.util.spec_from_file_location("docs_samples", ROOT / "docs" / "samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_samples"] = module
    spec.loader.exec_module(module)
    return module


def test_the_masking_keeps_every_figure_but_wall_times():
    s = samples()
    assert s.masked("completed in 18.1 s; z = 2.079") == s.masked("completed in 3 s; z = 2.079")
    assert s.masked('"seconds": 1.57, "units": 8') == s.masked('"seconds": 0.1, "units": 8')
    assert s.masked("z = 2.079") != s.masked("z = 2.080")


def test_every_sample_mark_has_its_block():
    s = samples()
    for name, sample in s.SAMPLES.items():
        text = (ROOT / sample.file).read_text()
        start, end = s.block(text, name)
        assert text[start:end].strip() if sample.python else s.commands(text[start:end]), name


def test_the_argument_errors_sample_is_current():
    assert samples().regenerate("usage-errors", check=True)


@pytest.mark.slow
def test_the_flower_simulation_sample_is_current():
    """20,000 users on 8 simulated nodes (Ray): the summary table and the round lines."""
    assert samples().regenerate("flower-sim8", check=True)


@pytest.mark.parametrize("name", ["readme-altmin", "usage-python", "noisygd-accountants"])
def test_the_fast_samples_are_current(name):
    """The README's worked example, usage.md's Python example and mechanisms.md's accountant
    comparison, digit for digit."""
    assert samples().regenerate(name, check=True)


@pytest.mark.slow
def test_the_noisygd_remedies_sample_is_current():
    assert samples().regenerate("noisygd-remedies", check=True)


def test_every_sample_is_checked_by_a_test():
    text = Path(__file__).read_text()
    assert all(f'"{name}"' in text for name in samples().SAMPLES)
