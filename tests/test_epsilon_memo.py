"""A run's reported ε reuses its calibration's check only for the very event the check passed:
the ledger's form of the plan equals the ledger's own composition of the same releases, a ledger
that differs from the plan is computed, and a changed accountant never answers from the memo."""

from __future__ import annotations

from pathlib import Path

import dp_accounting
import pytest

from fedpers.privacy import accountant
from fedpers.privacy.accountant import (
    calibrate_noise_multiplier,
    event_epsilon,
    fold_repeats,
    forget_epsilons,
    ledger_epsilon,
    ledger_form,
)
from fedpers.privacy.ledger import Ledger, PureDpEvent, Release

G = dp_accounting.GaussianDpEvent


def plan(z: float) -> dp_accounting.DpEvent:  # what one unit is touched by: three Gaussian rounds
    return dp_accounting.ComposedDpEvent([G(z), G(z), G(z)])


def ledger_of(*zs: float) -> Ledger:
    return Ledger([Release(t, "s", "gaussian", 1.0, 2.0, z, "all", G(z)) for t, z in enumerate(zs)])


@pytest.fixture
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The PLD accountant's computations (an empty memo, an empty calibration cache)."""
    from fedpers.privacy import calibration_cache

    monkeypatch.setenv(calibration_cache.DISABLE_ENV, "1")
    monkeypatch.setenv(calibration_cache.CACHE_DIR_ENV, str(tmp_path))
    calls: list[str] = []
    real = accountant.PldAccountant.epsilon

    def counting(self, event, delta, *, pld_discretisation):
        calls.append(repr(event))
        return real(self, event, delta, pld_discretisation=pld_discretisation)

    monkeypatch.setattr(accountant.PldAccountant, "epsilon", counting)
    forget_epsilons()
    yield calls
    forget_epsilons()


def test_the_ledger_form_is_the_ledgers_own_fold_of_the_releases():
    p = dp_accounting.PoissonSampledDpEvent(0.25, G(2.0))
    nested = dp_accounting.ComposedDpEvent(
        [G(3.0), dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([p, G(3.0), PureDpEvent(0.1)]), 4)]
    )
    releases = [G(3.0)] + [p, G(3.0), PureDpEvent(0.1)] * 4  # the same mechanisms, released one by one
    assert ledger_form(nested) == dp_accounting.ComposedDpEvent(fold_repeats(releases))
    assert ledger_form(nested).events == [
        dp_accounting.SelfComposedDpEvent(G(3.0), 5),
        dp_accounting.SelfComposedDpEvent(p, 4),
        dp_accounting.SelfComposedDpEvent(PureDpEvent(0.1), 4),
    ]
    assert ledger_form(G(3.0)) == dp_accounting.ComposedDpEvent([G(3.0)])


def test_a_run_of_its_plan_reports_the_checked_epsilon_and_a_ledger_off_the_plan_is_computed(counted):
    z = calibrate_noise_multiplier(plan, 2.0, 1e-5)  # solved, and cached
    assert calibrate_noise_multiplier(plan, 2.0, 1e-5) == z  # a cache hit: checked in the ledger's form
    solved = len(counted)
    assert counted[-1] == repr(dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(G(z), 3)]))

    reported = ledger_epsilon(ledger_of(z, z, z), 1e-5)
    assert len(counted) == solved  # the releases are the plan: no second PLD
    forget_epsilons()
    assert ledger_epsilon(ledger_of(z, z, z), 1e-5) == reported <= 2.0  # what the accountant gives, bit for bit
    assert len(counted) == solved + 1

    more = ledger_epsilon(ledger_of(z, z, z, z), 1e-5)  # one release more than planned: computed
    other = ledger_epsilon(ledger_of(z, z, z * (1 - 1e-9)), 1e-5)  # one multiplier off by 1e-9: computed
    assert len(counted) == solved + 3
    assert more > reported and other >= reported
    forget_epsilons()
    assert ledger_epsilon(ledger_of(z, z, z, z), 1e-5) == more
    assert ledger_epsilon(ledger_of(z, z, z * (1 - 1e-9)), 1e-5) == other


def test_a_changed_accountant_is_never_answered_from_the_memo(counted, monkeypatch):
    event = ledger_form(plan(3.0))
    first = event_epsilon(event, 1e-5)
    assert event_epsilon(event, 1e-5) == first and len(counted) == 1
    assert event_epsilon(event, 1e-6) > first  # another δ
    assert event_epsilon(event, 1e-5, "zcdp") > first  # another accountant (zCDP's conversion is looser)
    monkeypatch.setattr(accountant.PldAccountant, "epsilon", lambda self, e, d, *, pld_discretisation: 123.0)
    assert event_epsilon(event, 1e-5) == 123.0  # the patched method, not the remembered answer
