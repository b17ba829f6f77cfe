"""The on-disk calibration cache: a repeated solve returns the identical multiplier from the cache;
a corrupt or planted entry never changes the answer; the environment turns the cache off."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting
import pytest

from fedpers.privacy import accountant, calibration_cache
from fedpers.privacy.accountant import calibrate_noise_multiplier, event_epsilon
from fedpers.privacy.ledger import PureDpEvent


def gaussian(z: float) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 3)


def mixed(z: float) -> dp_accounting.DpEvent:  # not closed form: the bracketed solve
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z), PureDpEvent(0.5)])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(calibration_cache.DISABLE_ENV, "1")
    monkeypatch.setenv(calibration_cache.CACHE_DIR_ENV, str(tmp_path))
    return tmp_path / "calibrations"


def counting(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    calls: list[float] = []
    real = accountant._solve_calibration
    monkeypatch.setattr(accountant, "_solve_calibration", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("make", [gaussian, mixed])
def test_second_call_hits_the_cache_with_the_identical_multiplier(cache, monkeypatch, make):
    calls = counting(monkeypatch)
    first = calibrate_noise_multiplier(make, 2.0, 1e-5)
    assert calls == [1] and len(list(cache.glob("*.json"))) == 1
    second = calibrate_noise_multiplier(make, 2.0, 1e-5)
    assert calls == [1]  # no solve: the cached entry, bit for bit
    assert second.hex() == first.hex() and event_epsilon(make(second), 1e-5) <= 2.0
    monkeypatch.setenv(calibration_cache.DISABLE_ENV, "0")
    assert calibrate_noise_multiplier(make, 2.0, 1e-5).hex() == first.hex()  # the solve itself agrees
    assert calls == [1, 1]


def test_other_targets_and_accountants_are_other_entries(cache, monkeypatch):
    calls = counting(monkeypatch)
    a = calibrate_noise_multiplier(gaussian, 2.0, 1e-5)
    b = calibrate_noise_multiplier(gaussian, 3.0, 1e-5)
    c = calibrate_noise_multiplier(gaussian, 2.0, 1e-5, "zcdp")
    assert len(calls) == 3 and len({a, b, c}) == 3 and len(list(cache.glob("*.json"))) == 3


@pytest.mark.parametrize(
    "planted",
    [
        "not json",
        b"\xff\xfe",
        json.dumps({"key": "another key", "z": (1.0).hex()}),
        json.dumps({"z": (1.0).hex()}),
        json.dumps(["a list"]),
        "{}",
    ],
)
def test_a_corrupt_entry_is_solved_again(cache, monkeypatch, planted):
    calls = counting(monkeypatch)
    expected = calibrate_noise_multiplier(gaussian, 2.0, 1e-5)
    (entry,) = cache.glob("*.json")
    entry.write_bytes(planted if isinstance(planted, bytes) else planted.encode())
    assert calibrate_noise_multiplier(gaussian, 2.0, 1e-5).hex() == expected.hex()
    assert len(calls) == 2
    assert calibrate_noise_multiplier(gaussian, 2.0, 1e-5).hex() == expected.hex() and len(calls) == 2  # rewritten


@pytest.mark.parametrize("z", [float("nan"), float("inf"), -1.0, 0.0])
def test_an_entry_outside_the_multipliers_is_solved_again(cache, monkeypatch, z):
    expected = calibrate_noise_multiplier(gaussian, 2.0, 1e-5)
    (entry,) = cache.glob("*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "z": z.hex()}))
    assert calibrate_noise_multiplier(gaussian, 2.0, 1e-5).hex() == expected.hex()


def test_a_cached_multiplier_too_small_for_the_target_is_not_used(cache, monkeypatch):
    """The full-resolution check ε ≤ target still runs on a cached multiplier: a planted smaller
    z (more ε than the target) is refused and the solve runs."""
    expected = calibrate_noise_multiplier(gaussian, 2.0, 1e-5)
    (entry,) = cache.glob("*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "z": (expected * 0.9).hex()}))
    calls = counting(monkeypatch)
    assert calibrate_noise_multiplier(gaussian, 2.0, 1e-5).hex() == expected.hex() and calls == [1]


@pytest.mark.parametrize("off", ["0", "off", "false", "no"])
def test_the_environment_turns_the_cache_off(cache, monkeypatch, off):
    monkeypatch.setenv(calibration_cache.DISABLE_ENV, off)
    calls = counting(monkeypatch)
    calibrate_noise_multiplier(gaussian, 2.0, 1e-5)
    calibrate_noise_multiplier(gaussian, 2.0, 1e-5)
    assert len(calls) == 2 and not cache.exists()


def test_the_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(calibration_cache.DISABLE_ENV, raising=False)
    monkeypatch.delenv(calibration_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration_cache.cache_dir() == tmp_path / "fedpers" / "calibrations"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert calibration_cache.cache_dir() == tmp_path / ".cache" / "fedpers" / "calibrations"


def test_an_unwritable_cache_only_costs_the_solve(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(calibration_cache.DISABLE_ENV, "1")
    monkeypatch.setenv(calibration_cache.CACHE_DIR_ENV, str(blocker))  # a file where the folder would be
    calls = counting(monkeypatch)
    a = calibrate_noise_multiplier(gaussian, 2.0, 1e-5)
    assert calibrate_noise_multiplier(gaussian, 2.0, 1e-5) == a and len(calls) == 2
