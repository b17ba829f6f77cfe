"""Poisson user sampling: the inclusion rate is q, the amplified ε matches a hand computation,
the ledger records and round-trips the sampled events, and sampled-out users never move a release."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import optimize, stats

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import ALL_UNITS, Privatizer, event_epsilon
from fedpers.privacy.ledger import Release
from fedpers.protocols.noisyhead import descend as nh_descend
from fedpers.runner import execute
from tests.neighbours import adversaries, check_neighbour
from tests.small_runs import FEDREP_SMALL

EXP = EXPERIMENTS["fedrep"]


def hand_epsilon(z: float, q: float, delta: float) -> float:
    """ε of one Poisson-sampled Gaussian under replace-one, from the hockey-stick divergence of the
    worst pair (1−q)N(0, z²) + qN(+1, z²) vs (1−q)N(0, z²) + qN(−1, z²) by numerical integration
    (the replaced user is sampled with probability q in both datasets; its per-unit bound is 1),
    on a fine grid."""
    t = np.linspace(-40.0, 40.0, 2_000_001)
    dt = t[1] - t[0]
    p = (1 - q) * stats.norm.pdf(t, 0, z) + q * stats.norm.pdf(t, 1, z)
    r = (1 - q) * stats.norm.pdf(t, 0, z) + q * stats.norm.pdf(t, -1, z)
    return optimize.brentq(
        lambda e: float(np.maximum(0.0, p - math.exp(e) * r).sum() * dt) - delta, 1e-4, 10, xtol=1e-9
    )


@pytest.mark.parametrize("z,q", [(2.0, 0.1), (1.0, 0.01)])
def test_sampled_gaussian_epsilon_matches_hand_computation(z, q):
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    got = event_epsilon(event, 1e-6)
    assert got == pytest.approx(hand_epsilon(z, q, 1e-6), rel=2e-3)
    assert got < 0.5 * event_epsilon(dp_accounting.GaussianDpEvent(z), 1e-6)  # amplification is real


def test_poisson_sample_inclusion_rate():
    p = Privatizer(5)
    n, q = 200_000, 0.05
    masks = torch.stack([p.poisson_sample(n, q) for _ in range(3)])
    rate = masks.double().mean(1)
    sd = math.sqrt(q * (1 - q) / n)
    assert bool(((rate - q).abs() < 5 * sd).all()), rate
    assert not bool((masks[0] == masks[1]).all())  # a fresh draw each round
    with pytest.raises(ValueError, match="sampling rate"):
        p.poisson_sample(10, 0.0)


@pytest.mark.slow
def test_fedrep_poisson_run_is_accounted_with_sampled_events():
    cfg = config.build(
        EXP.config_type,
        dict(
            n_users=2000,
            dim=8,
            rank=2,
            samples_per_user=5,
            refit_samples=3,
            test_samples=10,
            rounds=4,
            epsilon=2.0,
            cohorts="poisson",
            sampling_rate=0.1,
            baselines="none",
            seed=2,
        ),
    )
    protocol = EXP.protocol(cfg)
    result = execute(EXP, cfg, write=False, progress=False)
    assert result["epsilon"] <= 2.0 and result["epsilon"] == pytest.approx(2.0, rel=1e-2)
    event = protocol.user_event(protocol.noise_multiplier, protocol.releases_per_user(), 0.1)
    unsampled = protocol.user_event(protocol.noise_multiplier, protocol.releases_per_user())
    assert event_epsilon(unsampled, cfg.delta) > 1.1 * event_epsilon(
        event, cfg.delta
    )  # the unsampled init dominates at q = 0.1
    # the sampled counts of the rounds are near q·n
    counts = [r["units"] for r in result["_rounds"][1:]]
    assert len(counts) == 4 and result["_rounds"][0]["units"] == 2000 and len(set(counts)) > 1
    for c in counts:
        assert abs(c - 200) < 5 * math.sqrt(2000 * 0.1 * 0.9)


def test_sampled_release_round_trips_through_the_ledger():
    event = dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(3.0))
    r = Release(1, "round1.G", "gaussian", 1.0, 2.0, 3.0, ALL_UNITS, event, {})
    back = Release.from_dict(r.to_dict())
    assert back.event == event and back.noise_multiplier == 3.0


@pytest.mark.slow  # > 10 s; in CI's slow run
def test_fedrep_poisson_worst_case_neighbours():
    cfg = config.build(
        EXP.config_type,
        {**FEDREP_SMALL, "rounds": 2, "cohorts": "poisson", "sampling_rate": 0.5},
    )
    protocol = EXP.protocol(cfg)
    units = EXP.units(cfg, torch.arange(cfg.n_users))
    for j in (0, 23):
        for label, new in adversaries(units["x"][j], units["y"][j], torch.float64).items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS})
            assert outcome.releases == 1 + cfg.rounds, label


def test_poisson_config_is_checked():
    with pytest.raises(ValueError, match="sampling_rate"):
        config.build(EXP.config_type, {"cohorts": "poisson"})
    with pytest.raises(ValueError, match="accountant must be pld"):
        config.build(EXP.config_type, {"cohorts": "poisson", "sampling_rate": 0.1, "accountant": "rdp"})


# ----- AltMin with Poisson cohorts ----------------------------------------------------------
ALTMIN = EXPERIMENTS["altmin"]


def test_altmin_round_on_one_sample_is_one_sampled_gaussian_by_hand():
    """A round's A and b are computed on one Poisson sample: the ledger composes the two
    Gaussians (z = 2√2 each) into N(z = 2), sampled once at q = 0.1 — the hand value above.
    Composing them as two independently sampled releases would be a different mechanism."""
    from fedpers.privacy import Ledger, ledger_epsilon

    z, q = 2.0 * math.sqrt(2.0), 0.1
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))

    def ledger(samples):
        return Ledger(
            [
                Release(1, f"round1.{s}", "gaussian", 1.0, 2.0, z, ALL_UNITS, event, {"poisson_sample": sample})
                for s, sample in zip("Ab", samples)
            ]
        )

    shared = ledger_epsilon(ledger(["round1", "round1"]), 1e-6)
    assert shared == pytest.approx(hand_epsilon(2.0, q, 1e-6), rel=2e-3)
    assert shared != pytest.approx(ledger_epsilon(ledger(["a", "b"]), 1e-6), rel=1e-3)


def test_altmin_poisson_run_accounts_each_round_as_one_sampled_mechanism():
    """A real (small) Poisson AltMin run: each round's A and b carry the round's one sample tag, so
    the ledger's ε is the init's Gaussian composed with T sampled (A, b) pairs, by hand; tagging b
    apart would account it as independently sampled (a smaller, wrong ε)."""
    from dataclasses import replace

    from fedpers.privacy import Privatizer as P
    from fedpers.privacy import ledger_epsilon
    from fedpers.runtime.local import run_local

    cfg = config.build(
        ALTMIN.config_type,
        dict(
            n_users=60,
            dim=4,
            rank=2,
            samples_per_user=8,
            rounds=2,
            epsilon=math.inf,
            cohorts="poisson",
            sampling_rate=0.5,
            baselines="none",
            delta=1e-5,
        ),
    )
    protocol = replace(ALTMIN.protocol(cfg), noise_multiplier=3.0)  # the calibration is tested elsewhere
    privatizer = P(1)
    run_local(protocol, ALTMIN.units(cfg, torch.arange(cfg.n_users)), privatizer, progress=False)
    releases = list(privatizer.ledger)
    rounds = sorted({r.round for r in releases if r.round > 0})
    assert len(rounds) == cfg.rounds
    parts = [r.event for r in releases if r.round == 0]
    for t in rounds:
        mine = [r for r in releases if r.round == t]
        assert (
            len(mine) == 2
            and len({r.params.get("poisson_sample") for r in mine}) == 1
            and mine[0].params.get("poisson_sample")
        )
        z = sum(r.event.event.noise_multiplier**-2 for r in mine) ** -0.5  # two Gaussians on one sample: one Gaussian
        parts.append(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(z)))
    by_hand = event_epsilon(dp_accounting.ComposedDpEvent(parts), cfg.delta)
    assert ledger_epsilon(privatizer.ledger, cfg.delta) == pytest.approx(by_hand, rel=1e-9)


@pytest.mark.slow
def test_altmin_poisson_run_meets_its_target_and_samples_about_q_n():
    cfg = config.build(
        ALTMIN.config_type,
        dict(
            n_users=20000,
            dim=6,
            rank=2,
            rounds=3,
            epsilon=2.0,
            cohorts="poisson",
            sampling_rate=0.2,
            baselines="none",
            seed=4,
        ),
    )
    result = execute(ALTMIN, cfg, write=False, progress=False)
    assert result["epsilon"] <= 2.0 and result["epsilon"] == pytest.approx(2.0, rel=1e-2)
    counts = [r["units"] for r in result["_rounds"][1:]]
    assert result["_rounds"][0]["units"] == 20000 and len(set(counts)) == 3
    for c in counts:
        assert abs(c - 4000) < 5 * math.sqrt(20000 * 0.2 * 0.8)
    disjoint = ALTMIN.protocol(
        config.build(ALTMIN.config_type, dict(n_users=20000, dim=6, rank=2, rounds=3, epsilon=2.0, baselines="none"))
    )
    assert ALTMIN.protocol(cfg).noise_multiplier < disjoint.noise_multiplier  # amplification buys less noise per round


@pytest.mark.slow
def test_altmin_poisson_worst_case_neighbours():
    cfg = config.build(
        ALTMIN.config_type,
        dict(
            n_users=40, dim=6, rank=2, samples_per_user=8, rounds=2, epsilon=2.0, cohorts="poisson", sampling_rate=0.5
        ),
    )
    protocol = ALTMIN.protocol(cfg)
    units = ALTMIN.units(cfg, torch.arange(cfg.n_users))
    for j in (0, 23):
        for label, new in adversaries(units["x"][j], units["y"][j], torch.float64).items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS})
            assert outcome.releases == 1 + 2 * cfg.rounds, label


def test_altmin_poisson_config_is_checked():
    with pytest.raises(ValueError, match="sampling_rate must be in"):
        config.build(ALTMIN.config_type, {"cohorts": "poisson"})
    with pytest.raises(ValueError, match="sampling_rate needs cohorts poisson"):
        config.build(ALTMIN.config_type, {"sampling_rate": 0.5})
    with pytest.raises(ValueError, match="calibration paper has no rule"):
        config.build(ALTMIN.config_type, {"cohorts": "poisson", "sampling_rate": 0.5, "calibration": "paper"})


NOISYHEAD = EXPERIMENTS["noisyhead"]
NH_USER = dict(
    prompts=4000,
    dim=3,
    context=3,
    unit="user",
    prompts_per_user=4,
    mode="rounds",
    steps=4,
    calibration="accountant",
    test_prompts=50,
    seed=2,
)


@pytest.mark.slow
def test_noisyhead_user_level_poisson_meets_its_target_samples_about_q_and_divides_by_qN():
    cfg = config.build(NOISYHEAD.config_type, {**NH_USER, "epsilon": 2.0, "sampling_rate": 0.25})
    result = execute(NOISYHEAD, cfg, write=False, progress=False)
    assert result["epsilon"] <= 2.0 and result["epsilon"] == pytest.approx(2.0, rel=1e-2)
    units = 4000 // 4
    counts = [r["units"] for r in result["_rounds"]]
    assert len(counts) == 4 and len(set(counts)) > 1
    for c in counts:
        assert abs(c - 250) < 5 * math.sqrt(units * 0.25 * 0.75)
    protocol = NOISYHEAD.protocol(cfg)
    full = NOISYHEAD.protocol(config.build(NOISYHEAD.config_type, {**NH_USER, "epsilon": 2.0}))
    assert protocol.noise_multiplier < full.noise_multiplier
    # the step divides the noisy sum by the public q·N: a unit gradient moves Γ by η₀/(qN)
    g = torch.zeros(protocol.dim**2, dtype=torch.float64)
    g[0] = 1.0
    moved = nh_descend(
        torch.zeros_like(g),
        g,
        protocol.prompts * protocol.sampling_rate,
        protocol.ridge_lambda,
        protocol.step_size,
        protocol.proj_r,
    )
    assert float(moved[0]) == pytest.approx(-protocol.step_size / (0.25 * 4000), rel=1e-9) or float(
        moved.norm()
    ) == pytest.approx(protocol.proj_r)


def test_noisyhead_one_sampled_step_is_the_hand_computed_amplified_gaussian():
    """One step at z = 2, q = 0.1 on the user level: the ledger's ε is the sampled Gaussian's by
    hand (0.5857 at δ = 1e-6), and the released noise std is z·bound (not divided by q)."""
    from dataclasses import replace

    from fedpers.experiments.noisyhead import step_event
    from fedpers.privacy import ledger_epsilon
    from fedpers.runtime.local import run_local

    hand = hand_epsilon(2.0, 0.1, 1e-6)
    assert event_epsilon(step_event(2.0, 1, 0.1), 1e-6) == pytest.approx(hand, rel=2e-3)
    cfg = config.build(
        NOISYHEAD.config_type,
        {**NH_USER, "prompts": 800, "steps": 1, "epsilon": math.inf, "delta": 1e-6, "sampling_rate": 0.1},
    )
    protocol = replace(NOISYHEAD.protocol(cfg), noise_multiplier=2.0)
    units = NOISYHEAD.units(cfg, torch.arange(200))
    privatizer = Privatizer(5)
    run_local(protocol, units, privatizer, progress=False)
    (release,) = list(privatizer.ledger)
    assert release.noise_std == pytest.approx(2.0 * protocol.grad_bound, rel=1e-12)
    assert ledger_epsilon(privatizer.ledger, 1e-6) == pytest.approx(hand, rel=2e-3)


def test_noisyhead_poisson_config_is_checked():
    with pytest.raises(ValueError, match="needs mode rounds"):
        config.build(NOISYHEAD.config_type, {**NH_USER, "mode": "statistics", "sampling_rate": 0.5})
    with pytest.raises(ValueError, match="calibration accountant"):
        config.build(NOISYHEAD.config_type, {**NH_USER, "calibration": "paper", "sampling_rate": 0.5})
    from fedpers.experiments.noisyhead.sweep import sweep_point

    with pytest.raises(ValueError, match="Monte-Carlo sweep engine"):
        sweep_point(config.build(NOISYHEAD.config_type, {**NH_USER, "sampling_rate": 0.5}), 2)


@pytest.mark.slow
def test_noisyhead_poisson_local_equals_flower_grid(tmp_path):
    from fedpers.app import make_client_app
    from fedpers.runner import Runtime, RuntimeOptions
    from tests.flower_support import InProcessGrid

    cfg = config.build(NOISYHEAD.config_type, {**NH_USER, "prompts": 400, "epsilon": 3.0, "sampling_rate": 0.3})
    local = execute(NOISYHEAD, cfg, out=tmp_path / "local", progress=False)
    flower = execute(
        NOISYHEAD,
        cfg,
        RuntimeOptions(runtime=Runtime.FLOWER, nodes=3),
        out=tmp_path / "flower",
        progress=False,
        grid=InProcessGrid(make_client_app(), 3),
    )
    torch.testing.assert_close(flower["_state"]["gamma"], local["_state"]["gamma"], rtol=1e-6, atol=1e-9)
    assert [r["units"] for r in flower["_rounds"]] == [r["units"] for r in local["_rounds"]]


def test_noisyhead_poisson_step_divides_the_sum_by_q_n():
    """Under Poisson sampling the step's gradient estimate is the noisy sum over the expected
    cohort q·N (unbiased for the mean gradient), not over N: with noise off, a sum g moves Γ
    from 0 by exactly −η₀·g/(qN) (inside the ball)."""
    from dataclasses import replace

    cfg = config.build(
        NOISYHEAD.config_type, {**NH_USER, "prompts": 800, "steps": 1, "epsilon": math.inf, "sampling_rate": 0.25}
    )
    protocol = replace(NOISYHEAD.protocol(cfg), noise_multiplier=0.0)
    g = torch.zeros(protocol.dim**2, dtype=torch.float64)
    g[0] = 1e-3 * protocol.prompts
    gamma, _ = protocol.noisy_step(0, torch.zeros_like(g), g, Privatizer(0))
    assert float(gamma.norm()) < protocol.proj_r
    assert float(gamma[0]) == pytest.approx(-protocol.step_size * float(g[0]) / (0.25 * protocol.prompts), rel=1e-12)
