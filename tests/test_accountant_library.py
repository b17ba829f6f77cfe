"""The accountants run on dp-accounting: fedpers' ε equals the library's wherever the library
computes the same thing, the one hand-written PLD path (EpsilonDeltaDpEvent) is pinned to the
library, every accountant supports or refuses each event kind with a message, and ledger
events serialise by the library's own round trip."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from fedpers import config
from fedpers.commands import cli
from fedpers.experiments import experiment
from fedpers.privacy import (
    ALL_UNITS,
    Accountant,
    Calibrations,
    EpsilonDeltaDpEvent,
    Ledger,
    PureDpEvent,
    Release,
    UnsupportedEvent,
    event_epsilon,
    ledger_epsilon,
)
from fedpers.privacy import accountant as accountant_lib
from fedpers.privacy.ledger import event_from_dict, event_to_dict

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
G = dp_accounting.GaussianDpEvent
POISSON = dp_accounting.PoissonSampledDpEvent(0.05, G(1.2))


def library_pld(event: dp_accounting.DpEvent, delta: float) -> float:
    acc = PLDAccountant(REPLACE_ONE, value_discretization_interval=accountant_lib.PLD_DISCRETISATION)
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(
    "event",
    [
        G(1.0),
        dp_accounting.SelfComposedDpEvent(G(3.0), 20),
        POISSON,
        dp_accounting.SelfComposedDpEvent(POISSON, 40),
        dp_accounting.ComposedDpEvent(
            [G(2.0), dp_accounting.SelfComposedDpEvent(POISSON, 10), dp_accounting.NoOpDpEvent()]
        ),
    ],
)
def test_pld_is_the_library_accountant(event):
    assert event_epsilon(event, 1e-5) == library_pld(event, 1e-5)


def test_pure_epsilon_is_the_library_randomized_response_and_the_stated_guarantee_agrees():
    """The added PureDpEvent is the library's two-bucket randomized response with the same ε;
    the added EpsilonDeltaDpEvent at δ = 0 is the same mechanism."""
    for eps in (0.1, 0.5, 2.0):
        rr = dp_accounting.RandomizedResponseDpEvent(noise_parameter=2 / (1 + math.exp(eps)), num_buckets=2)
        ours = event_epsilon(PureDpEvent(eps), 1e-6)
        assert ours == library_pld(rr, 1e-6) and ours == pytest.approx(eps, abs=2e-4)
        assert event_epsilon(EpsilonDeltaDpEvent(eps, 0.0), 1e-6) == pytest.approx(ours, abs=2e-4)


def test_repeated_pure_draws_count_every_draw():
    """dp-accounting 0.6.0's PLD accountant drops a SelfComposedDpEvent's count around a
    RandomizedResponseDpEvent; fedpers' PureDpEvent must not (k draws cost k·ε, not ε)."""
    drawn = dp_accounting.SelfComposedDpEvent(PureDpEvent(0.3), 3)
    assert event_epsilon(drawn, 1e-6) == pytest.approx(
        event_epsilon(dp_accounting.ComposedDpEvent([PureDpEvent(0.3)] * 3), 1e-6), rel=1e-6
    )
    assert event_epsilon(drawn, 1e-6) == pytest.approx(0.9, abs=1e-3)
    composed = dp_accounting.ComposedDpEvent([G(4.0), dp_accounting.SelfComposedDpEvent(PureDpEvent(0.3), 3)])
    stated = dp_accounting.ComposedDpEvent(
        [G(4.0), dp_accounting.SelfComposedDpEvent(EpsilonDeltaDpEvent(0.3, 0.0), 3)]
    )
    assert event_epsilon(stated, 1e-6) == pytest.approx(event_epsilon(composed, 1e-6), rel=1e-3)


def test_a_stated_epsilon_delta_is_exactly_its_guarantee_and_adds_to_the_rest():
    assert event_epsilon(EpsilonDeltaDpEvent(0.7, 1e-6), 1e-6) == pytest.approx(0.7, abs=2e-4)
    assert event_epsilon(EpsilonDeltaDpEvent(0.7, 1e-4), 1e-5) == math.inf  # δ below the stated δ
    with_gaussian = event_epsilon(dp_accounting.ComposedDpEvent([G(3.0), EpsilonDeltaDpEvent(0.7, 1e-7)]), 1e-5)
    assert event_epsilon(G(3.0), 1e-5) < with_gaussian < event_epsilon(G(3.0), 1e-5 - 1e-7) + 0.7 + 1e-6


def test_rdp_is_the_library_accountant_on_the_add_remove_equivalent():
    event = dp_accounting.SelfComposedDpEvent(G(2.0), 30)
    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(G(1.0), 30))
    assert event_epsilon(event, 1e-5, Accountant.RDP) == acc.get_epsilon(1e-5)


KINDS = {
    "gaussian": G(2.0),
    "poisson": POISSON,
    "pure": PureDpEvent(0.5),
    "stated": EpsilonDeltaDpEvent(0.5, 1e-7),
    "non_private": dp_accounting.NonPrivateDpEvent(),
    "noop": dp_accounting.NoOpDpEvent(),
    "zcdp": dp_accounting.ZCDpEvent(0.01),
    "laplace": dp_accounting.LaplaceDpEvent(1.0),
    "poisson_pure": dp_accounting.PoissonSampledDpEvent(0.1, PureDpEvent(1.0)),
}
SUPPORTED = {
    Accountant.PLD: {"gaussian", "poisson", "pure", "stated", "non_private", "noop"},
    Accountant.RDP: {"gaussian", "pure", "stated", "non_private", "noop", "zcdp"},
    Accountant.ZCDP: {"gaussian", "pure", "stated", "non_private", "noop", "zcdp"},
}


@pytest.mark.parametrize("acc", list(Accountant))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_accountant_supports_or_refuses_each_event_kind(acc, kind):
    event = dp_accounting.ComposedDpEvent([G(5.0), KINDS[kind]])  # inside a composition, as a ledger gives it
    if kind in SUPPORTED[acc]:
        eps = event_epsilon(event, 1e-5, acc)
        assert eps >= event_epsilon(G(5.0), 1e-5, acc) - 1e-9
        assert math.isinf(eps) == (kind == "non_private")
    else:
        named = {"poisson": "Poisson-sampled GaussianDpEvent", "poisson_pure": "Poisson-sampled PureDpEvent"}.get(
            kind, type(KINDS[kind]).__name__
        )
        with pytest.raises(
            UnsupportedEvent,
            match=rf"the {acc.value} accountant cannot account a {named}.*(use --accountant pld|no replace-one)",
        ) as e:
            event_epsilon(event, 1e-5, acc)
        assert isinstance(e.value, ValueError)


def poisson_run(tmp_path):
    """A run directory holding a Poisson-sampled release (as a Poisson run writes it)."""
    (tmp_path / "config.json").write_text(json.dumps({"algorithm": "altmin", "delta": 1e-5, "accountant": "pld"}))
    release = Release(1, "round1.G", "gaussian", 1.0, 2.0, 1.2, ALL_UNITS, POISSON, {"poisson_sample": 1})
    (tmp_path / "ledger.json").write_text(Ledger([release]).to_json())
    return tmp_path


@pytest.mark.parametrize("acc", ["rdp", "zcdp"])
def test_fedpers_privacy_refuses_a_poisson_run_with_rdp_or_zcdp_without_a_traceback(tmp_path, capsys, acc):
    run = poisson_run(tmp_path)
    assert cli.main(["privacy", str(run), "--accountant", acc]) == 2
    err = capsys.readouterr().err
    assert f"the {acc} accountant cannot account a Poisson-sampled GaussianDpEvent" in err and "Traceback" not in err
    assert cli.main(["privacy", str(run)]) == 0  # pld accounts it
    assert ledger_epsilon(Ledger.from_json((run / "ledger.json").read_text()), 1e-5) == library_pld(POISSON, 1e-5)


@pytest.mark.parametrize(
    "event", [*KINDS.values(), dp_accounting.ComposedDpEvent([G(1.0), dp_accounting.SelfComposedDpEvent(POISSON, 3)])]
)
def test_events_serialise_by_the_library_round_trip(event):
    d = json.loads(json.dumps(event_to_dict(event)))
    named = event.to_named_tuple()
    assert (
        (d["module_name"], d["class_name"])
        == (named.module_name, named.class_name)
        == (type(event).__module__, type(event).__name__)
    )
    assert event_from_dict(d) == event


def test_a_ledger_never_imports_what_it_names():
    with pytest.raises(ValueError, match="unknown dp event os.system"):
        event_from_dict({"module_name": "os", "class_name": "system"})


def test_ledgers_written_before_the_library_form_still_read():
    old = {
        "type": "poisson_sampled",
        "sampling_probability": 0.1,
        "event": {"type": "gaussian", "noise_multiplier": 2.0},
    }
    assert event_from_dict(old) == dp_accounting.PoissonSampledDpEvent(0.1, G(2.0))
    assert event_from_dict({"type": "epsilon_delta", "epsilon": 1.0, "delta": 1e-6}) == EpsilonDeltaDpEvent(1.0, 1e-6)


def test_calibrations_are_passed_explicitly_and_rebuild_without_the_accountant(monkeypatch):
    exp = experiment("altmin")
    cfg = config.build(exp.config_type, dict(n_users=2000, dim=6, rank=2, rounds=3, epsilon=2.0, baselines="none"))
    server = Calibrations()
    built = exp.protocol(cfg, server)
    assert list(server.table.values()) == [built.noise_multiplier] and built.noise_multiplier > 0
    monkeypatch.setattr(accountant_lib, "_calibrate", lambda *a, **k: pytest.fail("the accountant ran on a rebuild"))
    assert exp.protocol(cfg, Calibrations(server.table)) == built


def test_folding_repeated_releases_keeps_epsilon() -> None:
    """Equal releases folded into one self-composition: same ε (PLD), other events untouched."""
    import dp_accounting

    from fedpers.privacy.accountant import event_epsilon, fold_repeats

    g, h = dp_accounting.GaussianDpEvent(3.0), dp_accounting.GaussianDpEvent(5.0)
    nested = dp_accounting.ComposedDpEvent([h, h])
    events = [g, h, g, nested, g, nested]
    folded = fold_repeats(events)
    assert folded[:2] == [dp_accounting.SelfComposedDpEvent(g, 3), h] and folded[2:] == [nested, nested]
    plain = event_epsilon(dp_accounting.ComposedDpEvent(events), 1e-5)
    assert event_epsilon(dp_accounting.ComposedDpEvent(folded), 1e-5) == pytest.approx(plain, rel=1e-6)
