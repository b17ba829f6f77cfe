"""The declared neighbouring relation (``--neighbours replace-one|add-remove``): the peers' add/remove ε
reproduced, every bound-to-sensitivity rule following the relation (measured noise against the ledger's
claim, worst-case neighbours), the relation named in the ledger and in every view of a run, and the
combinations that cannot be accounted refused before any release."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
import torch

from fedpers import config
from fedpers.config import Neighbours
from fedpers.configs.privacy import check_poisson_accountant
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Ledger, Privatizer, Release, calibrate_noise_multiplier, event_epsilon, ledger_epsilon
from fedpers.privacy import correlated as cc
from fedpers.runner import execute, resolve
from tests.neighbours import check_neighbour
from tests.small_runs import FEDREP_SMALL

PEERS = [
    # (what, event, δ, ε) — pfl's and jax_privacy's add/remove PLD ε for the same noise
    ("one Gaussian, z = 1", dp_accounting.GaussianDpEvent(1.0), 1e-5, 4.3771781),
    (
        "Poisson q = 0.01, T = 1000, z = 1",
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 1000
        ),
        1e-5,
        1.82824365,
    ),
]


@pytest.mark.parametrize("what, event, delta, expected", PEERS, ids=[p[0] for p in PEERS])
def test_add_remove_reproduces_the_peers_epsilon(what, event, delta, expected):
    assert event_epsilon(event, delta, neighbours="add-remove") == pytest.approx(expected, rel=1e-7)
    # replace-one differs, and with sampling there is no factor-2 identity to convert by
    replace = event_epsilon(event, delta)
    assert replace > expected * 1.5


def test_the_peers_epsilon_from_jax_privacys_own_events():
    jp = pytest.importorskip("jax_privacy.experimental.accounting")
    assert event_epsilon(jp.dpsgd_event(1.0, 1000, sampling_prob=0.01), 1e-5, neighbours="add-remove") == pytest.approx(
        1.82824365, rel=1e-7
    )


def test_unsampled_replace_one_is_add_remove_at_half_the_multiplier_and_calibration_follows():
    g = dp_accounting.GaussianDpEvent
    assert event_epsilon(g(2.0), 1e-5) == pytest.approx(event_epsilon(g(1.0), 1e-5, neighbours="add-remove"), rel=1e-6)
    z = calibrate_noise_multiplier(g, 4.3771781, 1e-5, neighbours="add-remove")
    assert z == pytest.approx(1.0, rel=2e-4) and z >= 1.0 * (1 - 1e-6)
    for accountant in ("rdp", "zcdp"):
        a = event_epsilon(g(1.0), 1e-5, accountant, neighbours="add-remove")
        assert a == pytest.approx(event_epsilon(g(2.0), 1e-5, accountant), rel=1e-9)


def test_rdp_accounts_poisson_sampling_under_add_remove_only():
    sampled = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(2.0))
    assert math.isfinite(event_epsilon(sampled, 1e-5, "rdp", neighbours="add-remove"))
    with pytest.raises(ValueError, match="rdp accountant cannot account"):
        event_epsilon(sampled, 1e-5, "rdp")
    check_poisson_accountant("rdp", "cohorts poisson", "add-remove")
    with pytest.raises(ValueError, match="accountant must be pld with cohorts poisson"):
        check_poisson_accountant("rdp", "cohorts poisson")


# ----- the Privatizer: measured noise and sensitivity against the ledger's claim ---------------------
@pytest.mark.parametrize("neighbours", ["replace-one", "add-remove"])
@pytest.mark.parametrize("kind", ["gaussian", "psd", "correlated"])
def test_each_release_moves_by_its_recorded_sensitivity_and_adds_the_noise_its_event_claims(neighbours, kind):
    """σ measured from 40,000 draws and the largest true distance between neighbouring sums give
    μ = Δ/σ; the event claims μ = κ/z (κ = 2 replace-one, 1 add-remove). A sensitivity halved (σ
    halved) doubles the measured μ; the √2 PSD tightening applied under add-remove raises it by √2:
    both far outside the 3 % tolerance (the draws' own error is 0.4 %)."""
    bound, z = 1.5, 2.0
    p = Privatizer(7, neighbours=neighbours)
    factor = 2.0 if neighbours == "replace-one" else 1.0
    if kind == "gaussian":
        draws = torch.stack(
            [
                p.gaussian_sum(torch.zeros(400), per_unit_bound=bound, noise_multiplier=z, name="g", round=r)
                for r in range(100)
            ]
        )
        true_delta = factor * bound  # antipodal units at the bound / one unit from absent
    elif kind == "psd":
        draws = torch.stack(
            [
                torch.triu(
                    p.symmetric_gaussian_sum(
                        torch.zeros(28, 28), per_unit_bound=bound, noise_multiplier=z, name="A", round=r, psd_units=True
                    )
                )[torch.triu(torch.ones(28, 28)) > 0]
                for r in range(100)
            ]
        )
        true_delta = math.sqrt(2.0) * bound if neighbours == "replace-one" else bound  # B·e1e1ᵀ vs B·e2e2ᵀ / vs absent
    else:
        m = cc.mechanism("banded", 100, 4, 4)
        draws = torch.stack(
            [
                p.correlated_gaussian_sum(
                    torch.zeros(400, dtype=torch.float64),
                    per_unit_bound=bound,
                    noise_multiplier=z,
                    noise=m,
                    stream="G",
                    step=r,
                    name="c",
                    round=r + 1,
                )
                for r in range(100)
            ]
        )
        draws = m.strategy.matrix(100) @ draws  # Cx + z: the joint release the sensitivity is stated for
        true_delta = factor * bound * m.sensitivity.value  # the cycle's worst participation, aligned
    release = p.ledger.releases[-1]
    assert release.neighbours == neighbours and all(r.neighbours == neighbours for r in p.ledger)
    sigma = float(draws.std())
    assert sigma == pytest.approx(release.noise_std, rel=0.015)
    if kind == "correlated":
        joint_z = release.event.noise_multiplier / math.sqrt(100)  # T records compose to the joint Gaussian
        claimed, recorded = factor / joint_z, release.params["joint_sensitivity"]
    else:
        claimed, recorded = factor / release.event.noise_multiplier, release.sensitivity
    assert recorded == pytest.approx(true_delta, rel=1e-12)
    assert true_delta / sigma == pytest.approx(claimed, rel=0.03)


def test_a_ledger_names_one_relation_and_is_accounted_under_it():
    g = dp_accounting.GaussianDpEvent(1.0)
    ar = Ledger([Release(0, "s", "gaussian", 1.0, 1.0, 1.0, "all", g, {}, "add-remove")])
    assert ledger_epsilon(ar, 1e-5) == pytest.approx(4.3771781, rel=1e-7)
    old = Ledger.from_json(json.dumps([{k: v for k, v in r.to_dict().items() if k != "neighbours"} for r in ar]))
    assert old.releases[0].neighbours == "replace-one"  # written before the relation was recorded
    with pytest.raises(ValueError, match="share one neighbouring relation"):
        ledger_epsilon(Ledger([*ar, *old]), 1e-5)


# ----- runs: calibration, worst-case neighbours, views, refusals ---------------------------------------
FEDREP = EXPERIMENTS["fedrep"]
SMALL = {**FEDREP_SMALL, "rounds": 3}


def test_an_add_remove_run_is_calibrated_accounted_and_named_in_every_view(tmp_path):
    from fedpers.commands.privacy_report import privacy_report

    values = {**SMALL, "neighbours": "add-remove"}
    result = execute(FEDREP, config.build(FEDREP.config_type, values), out=tmp_path / "run", progress=False)
    replace = FEDREP.protocol(config.build(FEDREP.config_type, SMALL))
    assert result["privacy"]["neighbours"] == "add-remove" and "add-remove" in result["privacy"]["neighbouring"]
    # unsampled Gaussians: the same guarantee at half the multiplier
    assert result["privacy"]["noise_multiplier"] == pytest.approx(replace.noise_multiplier / 2, rel=2e-3)
    assert 2.0 * (1 - 2e-3) <= result["privacy"]["epsilon"] <= 2.0
    saved = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert {r["neighbours"] for r in saved} == {"add-remove"}
    assert {r["sensitivity"] / r["per_unit_bound"] for r in saved} == {1.0}
    assert "add-remove" in privacy_report(tmp_path / "run")


def test_a_user_removed_moves_each_release_by_at_most_its_add_remove_sensitivity():
    cfg = config.build(FEDREP.config_type, {**SMALL, "neighbours": "add-remove", "clip": 0.05})
    protocol = FEDREP.protocol(cfg)
    units = {k: v.clone() for k, v in FEDREP.units(cfg, torch.arange(cfg.n_users)).items()}
    j = 5
    units["y"][j] = units["y"][j] * 1e3  # at every bound
    outcome = check_neighbour(
        protocol, units, j, {"x": torch.zeros_like(units["x"][j])}, {"all"}, neighbours="add-remove"
    )
    reach = {r.name: moved / r.sensitivity for r, moved in outcome.changes}
    assert min(v for k, v in reach.items() if k != "init.W") > 0.99  # at the clip in every round
    assert reach["init.W"] > 0.3  # its random x pairs reach part of the init's bound


@pytest.mark.parametrize(
    "name, values, match",
    [
        ("dpattention", {"neighbours": "add-remove"}, "neighbours must be replace-one for dpattention"),
        ("altmin", {"neighbours": "add-remove", "calibration": "paper"}, "calibration paper: Theorem 4.2"),
        ("noisyhead", {"neighbours": "add-remove", "calibration": "paper"}, "calibration paper: the per-step"),
        ("fedrep", {"neighbours": "both"}, "neighbours must be one of replace-one, add-remove"),
        (
            "fedrep",
            {"cohorts": "poisson", "sampling_rate": 0.1, "accountant": "zcdp", "neighbours": "add-remove"},
            "accountant must be pld or rdp or mmcc with cohorts poisson",
        ),
    ],
)
def test_combinations_that_cannot_be_accounted_are_refused_naming_the_field(name, values, match):
    with pytest.raises(ValueError, match=match):
        config.build(EXPERIMENTS[name].config_type, values)


def test_local_dp_refuses_add_remove_before_any_release():
    """Local DP's per-unit releases are replace-one; distributed DP records add-remove sensitivities
    (tests/test_skellam_sampled.py)."""
    cfg = config.build(FEDREP.config_type, {**SMALL, "neighbours": "add-remove", "accountant": "rdp"})
    with pytest.raises(ValueError, match="neighbours add-remove needs dp_model central or distributed"):
        resolve(FEDREP, cfg, config.build(RuntimeOptions, {"nodes": 3, "dp_model": "local"}))


def test_the_canary_audit_refuses_add_remove():
    from fedpers.audit import audit

    cfg = config.build(FEDREP.config_type, {**SMALL, "neighbours": "add-remove"})
    with pytest.raises(ValueError, match="neighbours must be replace-one for the canary audit"):
        audit(FEDREP, cfg, canaries=4)


def test_dpcovariance_refuses_add_remove_in_the_mechanism_too():
    from fedpers.privacy import DpCovarianceParams

    p = Privatizer(0, neighbours=Neighbours.ADD_REMOVE)
    params = DpCovarianceParams(2, 4, 3, 0.05, 1e-5, 1.0, 1e-6, 0.01, 0.05, 0.1)
    with pytest.raises(ValueError, match="DPCovariance"):
        p.dp_covariance(torch.eye(2) * 0.02, params=params, name="B", round=0)
    assert len(p.ledger) == 0
