"""Cyclic cohorts and correlated (matrix-factorization) noise: the noise recurrence against dense
C⁻¹z, the sensitivity against brute force, worst-case neighbours on the joint release, the
ledger against the configuration, one band against independent noise bit for bit, refusals."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import ALL_UNITS, Privatizer, event_epsilon, ledger_epsilon
from fedpers.privacy import correlated as cc
from fedpers.protocols.fedrep import FedRepProtocol
from fedpers.runtime.local import run_local
from tests.neighbours import TapPrivatizer, adversaries, check_neighbour, replace_unit
from tests.small_runs import FEDREP_SMALL, NOISYGD_SMALL, built

EXP = EXPERIMENTS["fedrep"]
SMALL = {**FEDREP_SMALL, "rounds": 7, "cohorts": "cyclic", "cycle": 3}


def strategies(horizon: int) -> list[cc.Strategy]:
    out = [cc.strategy("independent", horizon, 1, 1)]
    out += [cc.strategy("banded", horizon, b, b) for b in sorted({1, 2, 5, 17} & set(range(1, horizon + 1)))]
    out.append(cc.Strategy("optimised", cc.optimised_coefficients(min(horizon, 40), min(horizon, 4), 4, iterations=10)))
    out.append(cc.Strategy("blt", (1.0,), (0.9, 0.5), (0.3, 0.2)))
    out.append(cc.Strategy("blt", (1.0,), *cc.optimised_blt(min(horizon, 24), 3, 4, iterations=10)))
    return out


@pytest.mark.parametrize("horizon", [1, pytest.param(9, marks=pytest.mark.slow), 200])
def test_each_round_noise_is_the_slice_of_dense_C_inverse_z(horizon):
    g = torch.Generator().manual_seed(horizon)
    z = torch.randn(horizon, 3, 2, generator=g, dtype=torch.float64)
    for s in strategies(horizon):
        dense = torch.linalg.solve_triangular(s.matrix(horizon), z.reshape(horizon, -1), upper=False).reshape(z.shape)
        rec = s.recurrence()
        rows = [rec.next(z[t]) for t in range(horizon)]
        torch.testing.assert_close(torch.stack(rows), dense, rtol=1e-10, atol=1e-10)
        assert len(rec.history) <= max(s.bands - 1, s.buffers)  # O(bands or buffers) vectors, never the history


def test_privatizer_noise_is_the_recurrence_and_one_band_is_independent_noise_bit_for_bit():
    horizon, cycle = 12, 4
    value = torch.randn(5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    one = cc.mechanism("banded", horizon, 1, cycle)
    assert one.noise_std(2.5, 0.7) == 2.5 * 0.7  # s/√P = 1 exactly for C = I
    a, b = Privatizer(9), Privatizer(9)
    for t in range(horizon):
        x = a.gaussian_sum(value, per_unit_bound=0.7, noise_multiplier=2.5, name="g", round=t + 1)
        y = b.correlated_gaussian_sum(
            value, per_unit_bound=0.7, noise_multiplier=2.5, noise=one, stream="G", step=t, name="g", round=t + 1
        )
        assert torch.equal(x, y)
    # a banded stream: released − value = σ·(C⁻¹z)_t with z the generator's standard normals in order
    m = cc.mechanism("banded", horizon, 3, cycle)
    p = Privatizer(4)
    noise = torch.stack(
        [
            p.correlated_gaussian_sum(
                value.double(),
                per_unit_bound=0.7,
                noise_multiplier=2.5,
                noise=m,
                stream="G",
                step=t,
                name="g",
                round=t + 1,
            )
            - value.double()
            for t in range(horizon)
        ]
    )
    gen = torch.Generator().manual_seed(4)
    z = torch.stack([torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(horizon)])
    sigma = m.noise_std(2.5, 0.7)
    dense = torch.linalg.solve_triangular(m.strategy.matrix(horizon), z.reshape(horizon, -1), upper=False)
    torch.testing.assert_close(noise, sigma * dense.reshape(z.shape), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="expects step"):
        p.correlated_gaussian_sum(
            value, per_unit_bound=0.7, noise_multiplier=2.5, noise=m, stream="G", step=3, name="g", round=4
        )


def brute_force(C: torch.Tensor, patterns: torch.Tensor) -> float:
    """max over patterns and signed scalar contributions g_t ∈ {−1, +1} of ‖Σ_t C[:, t] g_t‖."""
    best = 0.0
    for p in patterns:
        S = p.nonzero().squeeze(1)
        for signs in itertools.product((-1.0, 1.0), repeat=len(S)):
            v = C[:, S] @ torch.tensor(signs, dtype=C.dtype)
            best = max(best, float(torch.linalg.vector_norm(v)))
    return best


def some_patterns(horizon: int) -> list[torch.Tensor]:
    """Cyclic participations for every K, plus every subset of rounds (any participation pattern)."""
    out = [cc.cyclic_participation(horizon, k) for k in range(1, horizon + 1)]
    every = torch.tensor(list(itertools.product((0.0, 1.0), repeat=horizon)), dtype=torch.float64)[1:]
    return [*out, every]


@pytest.mark.parametrize("horizon", [4, 7])
def test_sensitivity_equals_brute_force_for_non_negative_and_banded_C(horizon):
    g = torch.Generator().manual_seed(horizon)
    Cs = [s.matrix(horizon) for s in strategies(horizon)]
    Cs.append(torch.tril(torch.rand(horizon, horizon, generator=g, dtype=torch.float64)) + torch.eye(horizon))
    for C, patterns in itertools.product(Cs, some_patterns(horizon)):
        got = cc.sensitivity(C, patterns)
        assert got.rule != "absolute Gram bound (upper bound)"
        assert got.value == pytest.approx(brute_force(C, patterns), rel=1e-12)
        assert got.participations == int(patterns.sum(1).max())


def test_orthogonal_shortcut_applies_when_bands_do_not_exceed_the_cycle():
    for horizon, cycle in [(12, 4), (13, 5), (200, 16)]:
        patterns = cc.cyclic_participation(horizon, cycle)
        for b in range(1, cycle + 1):
            C = cc.strategy("banded", horizon, b, cycle).matrix(horizon)
            got = cc.sensitivity(C, patterns)
            assert got.rule == "orthogonal columns"
            direct = max(float(torch.linalg.vector_norm(C @ p)) for p in patterns)  # C ≥ 0: ‖C p‖ is the maximum
            assert got.value == pytest.approx(direct, rel=1e-12)
        C = cc.strategy("banded", horizon, cycle + 1, cycle).matrix(horizon)
        assert cc.sensitivity(C, patterns).rule == "non-negative Gram"


def test_sensitivity_with_negative_gram_entries_is_never_below_any_signed_contribution():
    """A C with negative entries: ‖C p‖ (all contributions equal) understates what a user moves."""
    C = torch.tensor([[1.0, 0.0, 0.0], [-0.9, 1.0, 0.0], [0.0, -0.9, 1.0]], dtype=torch.float64)
    patterns = cc.cyclic_participation(3, 1)
    got = cc.sensitivity(C, patterns)
    brute = brute_force(C, patterns)
    assert float(torch.linalg.vector_norm(C @ patterns[0])) < 0.8 * brute
    assert got.value >= brute * (1 - 1e-12)
    assert got.rule == "absolute Gram bound (upper bound)"
    g = torch.Generator().manual_seed(0)
    for horizon in (4, 6):
        C = torch.tril(torch.randn(horizon, horizon, generator=g, dtype=torch.float64))
        for patterns in some_patterns(horizon):
            assert cc.sensitivity(C, patterns).value >= brute_force(C, patterns) * (1 - 1e-12)


def test_single_participation_sensitivity_is_not_enough_under_a_cycle():
    """Users in every K-th round move Cx by √⌈T/K⌉ columns, not by the largest column."""
    horizon, cycle = 12, 4
    m = cc.mechanism("banded", horizon, cycle, cycle)
    C = m.strategy.matrix(horizon)
    largest_column = float(torch.linalg.vector_norm(C, dim=0).max())
    assert m.sensitivity.participations == 3
    assert m.sensitivity.value == pytest.approx(brute_force(C, cc.cyclic_participation(horizon, cycle)), rel=1e-12)
    assert m.sensitivity.value > 1.5 * largest_column


def test_optimised_strategy_beats_the_square_root_and_independent_noise_on_its_loss():
    horizon, cycle = 64, 4
    patterns = cc.cyclic_participation(horizon, cycle)
    opt = cc.optimised_coefficients(horizon, cycle, cycle)
    value = {
        k: float(cc.loss(torch.tensor(c, dtype=torch.float64), horizon, patterns))
        for k, c in {"opt": opt, "sqrt": cc.sqrt_coefficients(cycle), "ind": (1.0,)}.items()
    }
    assert value["opt"] <= value["sqrt"] < value["ind"]
    assert all(c >= 0 for c in opt) and opt[0] == 1.0


def test_decayed_workload_is_the_contracting_iterate_and_its_error_is_dense():
    """A_λ x = the iterates of x_t = λ·x_{t−1} + g_t, and prefix_error(λ) = ‖A_λ C⁻¹‖_F² densely."""
    horizon, lam = 11, 0.6
    g = torch.randn(horizon, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x, iterates = torch.zeros((), dtype=torch.float64), []
    for t in range(horizon):
        x = lam * x + g[t]
        iterates.append(x)
    torch.testing.assert_close(cc.decay_workload(horizon, lam) @ g, torch.stack(iterates), rtol=1e-12, atol=1e-12)
    for s in (cc.Strategy("banded", cc.sqrt_coefficients(3)), cc.Strategy("blt", (1.0,), (0.9, 0.5), (0.3, 0.2))):
        c, C = s.toeplitz_coefficients(horizon), s.matrix(horizon)
        dense = float((cc.decay_workload(horizon, lam) @ torch.linalg.inv(C)).square().sum())
        assert float(cc.prefix_error(c, horizon, lam)) == pytest.approx(dense, rel=1e-10)


@pytest.mark.parametrize("horizon, cycle, lam", [(16, 4, 1.0), (12, 4, 0.5), (12, 1, 1.0), (16, 8, 0.3)])
def test_optimised_strategies_are_never_worse_than_independent_noise_on_their_workload(horizon, cycle, lam):
    """Independent noise is a feasible banded C and a feasible BLT (ω = 0): neither optimiser may
    return a strategy whose loss (squared sensitivity × ‖A_λ C⁻¹‖_F²) is above it, nor above the
    square root of A_λ; a decayed workload (what a contracting protocol pays for) lowers the gain."""
    patterns = cc.cyclic_participation(horizon, cycle)
    ind = float(cc.loss(torch.ones(1, dtype=torch.float64), horizon, patterns, lam))
    b = max(cycle, 2)
    banded = cc.mechanism("optimised", horizon, b, cycle, lam)
    s = cc.Strategy("blt", (1.0,), *cc.optimised_blt(horizon, 3, cycle, iterations=30, decay=lam))
    blt = cc.CorrelatedNoise(s, horizon, cc.sensitivity(s.matrix(horizon), patterns), cycle, lam)
    sqrt = torch.tensor(cc.sqrt_decay_coefficients(b, lam), dtype=torch.float64)
    for m in (banded, blt):
        c = m.strategy.toeplitz_coefficients(horizon)
        assert bool((c >= 0).all()) and m.sensitivity.rule != "absolute Gram bound (upper bound)"
        value = float(cc.loss(c, horizon, patterns, lam))
        assert value <= ind * (1 + 1e-12)
        assert value == pytest.approx(m.sensitivity.value**2 * float(cc.prefix_error(c, horizon, lam)), rel=1e-9)
    assert float(cc.loss(banded.strategy.toeplitz_coefficients(horizon), horizon, patterns, lam)) <= float(
        cc.loss(sqrt, horizon, patterns, lam)
    ) * (1 + 1e-12)
    if cycle >= 4 and lam == 1.0:
        assert float(cc.loss(banded.strategy.toeplitz_coefficients(horizon), horizon, patterns, lam)) < 0.5 * ind
    assert banded.decay == lam and banded.params()["workload_decay"] == lam


def test_privatizer_blt_noise_is_sigma_times_the_dense_slice():
    horizon, cycle = 12, 3
    s = cc.Strategy("blt", (1.0,), (0.95, 0.6, 0.2), (0.25, 0.1, 0.05))
    m = cc.CorrelatedNoise(
        s, horizon, cc.sensitivity(s.matrix(horizon), cc.cyclic_participation(horizon, cycle)), cycle
    )
    value = torch.randn(4, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p = Privatizer(8)
    noise = torch.stack(
        [
            p.correlated_gaussian_sum(
                value, per_unit_bound=0.7, noise_multiplier=2.5, noise=m, stream="G", step=t, name="g", round=t + 1
            )
            - value
            for t in range(horizon)
        ]
    )
    gen = torch.Generator().manual_seed(8)
    z = torch.stack([torch.randn(4, 2, generator=gen, dtype=torch.float64) for _ in range(horizon)])
    dense = torch.linalg.solve_triangular(s.matrix(horizon), z.reshape(horizon, -1), upper=False)
    torch.testing.assert_close(noise, m.noise_std(2.5, 0.7) * dense.reshape(z.shape), rtol=1e-9, atol=1e-9)
    first = next(iter(p.ledger))
    assert first.params["buffers"] == 3 and first.params["bands"] == 0
    other = cc.CorrelatedNoise(
        cc.Strategy("blt", (1.0,), (0.95, 0.6, 0.2), (0.25, 0.1, 0.06)), horizon, m.sensitivity, cycle
    )
    with pytest.raises(ValueError, match="own strategy"):  # a stream cannot switch strategy midway
        p.correlated_gaussian_sum(
            value,
            per_unit_bound=0.7,
            noise_multiplier=2.5,
            noise=other,
            stream="G",
            step=horizon - 1,
            name="g",
            round=horizon,
        )


# ----- the protocols ----------------------------------------------------------------------------
def setup(values: dict):
    return built(EXP, values)


def test_cyclic_cohorts_use_the_public_blocks_divide_by_their_size_and_are_accounted_per_cohort():
    cfg, protocol, units = setup(SMALL)
    assert protocol.cycle == 3 and protocol.releases_per_user() == 1 + 3  # ⌈7/3⌉ rounds per user
    sizes = [protocol.cohort_size(r) for r in range(1, 4)]
    assert sizes == [14, 13, 13] and sum(sizes) == cfg.n_users
    ids = torch.arange(cfg.n_users)
    for r in range(1, 8):
        start, stop = protocol.cohort_range(protocol.round_cohort(r))
        assert protocol.units_in_round(r, units) == stop - start
        assert bool(((protocol.cohort_of(ids) == (r - 1) % 3) == ((ids >= start) & (ids < stop))).all())
    privatizer = TapPrivatizer(3)
    run_local(protocol, units, privatizer, chunk_size=7, progress=False)
    groups = [r.units for r in privatizer.ledger]
    assert groups == [ALL_UNITS] + [f"cohort:{(r - 1) % 3}" for r in range(1, 8)]
    # the estimator's divisor is the public cohort size: U moves by η·G/|cohort| before orthonormalising
    eps = ledger_epsilon(privatizer.ledger, cfg.delta, cfg.accountant)
    assert eps == pytest.approx(
        event_epsilon(FedRepProtocol.user_event(protocol.noise_multiplier, 4), cfg.delta), rel=1e-6
    )
    assert eps <= cfg.epsilon * (1 + 1e-6)


@pytest.mark.slow  # ~10 s; the adaptive-clip neighbour test below covers cyclic cohorts in the default suite
def test_cyclic_worst_case_neighbour_moves_only_its_cohort_releases():
    cfg, protocol, units = setup(SMALL)
    for j in (27,):
        for label in ("huge x", "alternating y"):
            new = adversaries(units["x"][j], units["y"][j], torch.float64)[label]
            cohort = int(protocol.cohort_of(torch.tensor([j])))
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS, f"cohort:{cohort}"})
            assert outcome.releases == 1 + cfg.rounds, label


@pytest.mark.slow  # ~7 s; NoisyGD's correlated neighbour test below covers ‖C·Δx‖ ≤ joint Δ in the default suite
@pytest.mark.parametrize("noise", ["banded", "optimised"])
def test_correlated_worst_case_neighbour_moves_Cx_by_at_most_the_joint_sensitivity(noise):
    """A user with maximal gradients in every round it takes part in: ‖C·Δx‖_F over the rounds'
    pre-noise sums is ≤ the joint Δ = 2C·s the ledger records (broadcasts replayed, so adaptive)."""
    cfg, protocol, units = setup({**SMALL, "noise": noise, "clip": 0.05})
    assert protocol.correlated is not None
    C = protocol.correlated.strategy.matrix(cfg.rounds)
    largest = 0.0
    for j in (2,):
        new = adversaries(units["x"][j], units["y"][j], torch.float64)["alternating y"]
        reference = TapPrivatizer(3)
        run_local(protocol, units, reference, chunk_size=7, progress=False)
        replayed = TapPrivatizer(3, replay=reference.outputs)
        run_local(protocol, replace_unit(units, j, new), replayed, chunk_size=7, progress=False)
        rounds = [
            (r, b, a)
            for (r, b), (_, a) in zip(reference.values, replayed.values)
            if r.mechanism == "correlated_gaussian"
        ]
        assert len(rounds) == cfg.rounds
        joint = rounds[0][0].params["joint_sensitivity"]
        assert all(r.sensitivity == pytest.approx(joint / math.sqrt(cfg.rounds)) for r, _, _ in rounds)
        dx = torch.stack([(a - b).double().flatten() for _, b, a in rounds])
        moved = float(torch.linalg.matrix_norm(C @ dx))
        assert moved <= joint * (1 + 1e-9)
        largest = max(largest, moved / joint)
    assert largest > 0.3  # the planted user reaches a good part of the joint sensitivity


@pytest.mark.parametrize(
    "noise", ["banded", pytest.param("optimised", marks=pytest.mark.slow), pytest.param("blt", marks=pytest.mark.slow)]
)
def test_correlated_ledger_recomputed_from_the_config_gives_the_reported_epsilon(noise):
    values = {**SMALL, "noise": noise, "rounds": 9, "epsilon": 3.0, **({"noise_decay": 0.6} if noise == "blt" else {})}
    cfg, protocol, units = setup(values)
    privatizer = Privatizer(5)
    run_local(protocol, units, privatizer, chunk_size=40, progress=False)
    reported = EXP.privacy_summary(cfg, protocol, privatizer.ledger)
    assert reported["noise"] == noise and reported["releases_per_user"] == 4
    assert [r.units for r in privatizer.ledger] == [ALL_UNITS] * 10  # the joint mechanism touches every user
    again = EXP.protocol(config.build(EXP.config_type, values))
    assert again.correlated == protocol.correlated and again.noise_multiplier == protocol.noise_multiplier
    recomputed = event_epsilon(FedRepProtocol.user_event(again.noise_multiplier, again.releases_per_user()), cfg.delta)
    assert reported["epsilon"] == pytest.approx(recomputed, rel=2e-3)
    assert reported["epsilon"] <= 3.0 * (1 + 2e-3)


@pytest.mark.slow  # ~6 s; the Privatizer-level one-band test above stays in the default suite
def test_one_band_gives_todays_independent_fedrep_bit_for_bit():
    outs = []
    for extra in ({}, {"noise": "banded", "bands": 1}):
        cfg, protocol, units = setup({**SMALL, **extra})
        state, _ = run_local(protocol, units, Privatizer(11), chunk_size=7, progress=False)
        outs.append(state["U"])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "values, field_name",
    [
        ({"cohorts": "poisson", "sampling_rate": 0.5, "cycle": 1, "noise": "blt"}, "noise: blt with cohorts poisson"),
        (
            {"cohorts": "poisson", "cycle": 1, "sampling_rate": 0.25, "noise": "banded", "bands": 5},
            "bands must be <= 1/sampling_rate",
        ),
        (
            {"cohorts": "poisson", "cycle": 1, "sampling_rate": 0.25, "noise": "banded", "clip_rule": "adaptive"},
            "clip_rule adaptive",
        ),
        ({"cohorts": "all", "cycle": 4}, "cycle"),
        ({"cycle": 41}, "cycle"),
        ({"noise": "toeplitz"}, "noise"),
        ({"noise_decay": 0.5}, "noise_decay"),
        ({"noise": "banded", "noise_decay": 1.5}, "noise_decay"),
        ({"noise": "banded", "bands": 8}, "bands"),
        ({"bands": 2}, "bands"),
    ],
)
def test_unaccountable_cohort_or_noise_settings_are_refused_naming_the_field(values, field_name):
    with pytest.raises(ValueError, match=field_name):
        config.build(EXP.config_type, {**SMALL, **values})


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_secure_noise_draws_the_correlated_stream_from_os_entropy(noise):
    """With secure_noise the released noise σ·w (read back as release − value) satisfies C·w = z with z
    i.i.d. N(0, 1): each round's fresh draw is independent, its offset the earlier rounds' noise. Dropping
    the offset (w = z) gives Var((Cw)_t) = Σ c_k² (1.49 for the 4-band square root), far outside."""
    T, dim = 60, 40
    m = cc.mechanism(noise, T, 4, 4)
    p = Privatizer(0, secure=True)
    value = torch.linspace(-3.0, 3.0, dim, dtype=torch.float64)
    sigma = m.noise_std(1.0, 1.0)
    w = torch.stack(
        [
            (
                p.correlated_gaussian_sum(
                    value,
                    per_unit_bound=1.0,
                    noise_multiplier=1.0,
                    noise=m,
                    stream="G",
                    step=t,
                    name=f"g{t}",
                    round=t + 1,
                )
                - value
            )
            / sigma
            for t in range(T)
        ]
    )
    assert len(p.ledger) == T and "generator" not in p.state_dict()
    z = m.strategy.matrix(T) @ w  # (T, dim): should be i.i.d. standard normal
    # mean and lag-1 product at 6 sd: false failure 2e-9 each a run (at 5 sd the two were 1.1e-6 together);
    # the dropped offset's lag-1 product (Σ c_k·c_{k+1} = 0.80 banded, 1.29 BLT) stays over 39 sd out
    assert abs(float(z.mean())) < 6 / math.sqrt(z.numel())
    # the sample variance of 2,400 standard normals has sd 0.029 (measured over 200 draws: 0.030), so
    # abs=0.25 is 8 sd: a false failure about once in 10¹⁵ runs (OS entropy: no seed makes it repeatable),
    # while the dropped offset's 1.49 stays 16 sd outside
    assert float(z.var()) == pytest.approx(1.0, abs=0.25)
    lag = float((z[1:] * z[:-1]).mean())
    assert abs(lag) < 6 / math.sqrt(z[1:].numel())
    assert sum(c**2 for c in m.strategy.toeplitz_coefficients(T)) > 1.3  # the mistake the variance check catches


# ----- NoisyGD (example-level units) -------------------------------------------------------------
GD = EXPERIMENTS["noisygd"]
GD_SMALL = {**NOISYGD_SMALL, "examples": 60, "steps": 7, "cohorts": "cyclic", "cycle": 3}


def gd_setup(values: dict):
    return built(GD, values)


def test_noisygd_cyclic_cohorts_one_band_and_the_ledger():
    """Cohort labels per step, ε from the ledger = the calibration's, one band = independent bit for bit,
    and a correlated run touches every example through releases that compose to the joint mechanism."""
    U = []
    for extra in ({}, {"noise": "banded", "bands": 1}, {"noise": "banded"}):
        cfg, protocol, units = gd_setup({**GD_SMALL, **extra})
        assert protocol.participations() == 3
        privatizer = Privatizer(2)
        state, _ = run_local(protocol, units, privatizer, chunk_size=11, progress=False)
        U.append(state["W"])
        summary = GD.privacy_summary(cfg, protocol, privatizer.ledger)
        assert summary["epsilon"] <= 2.0 * (1 + 2e-3) and summary["epsilon"] == pytest.approx(2.0, rel=2e-2)
        if not extra:
            assert [r.units for r in privatizer.ledger] == [f"cohort:{s % 3}" for s in range(7)]
    assert torch.equal(U[0], U[1]) and not torch.equal(U[0], U[2])


def test_noisygd_correlated_worst_case_neighbour_moves_Cx_by_at_most_the_joint_sensitivity():
    cfg, protocol, units = gd_setup({**GD_SMALL, "noise": "banded"})
    C = protocol.correlated.strategy.matrix(cfg.steps)
    j = 4
    reference = TapPrivatizer(3)
    run_local(protocol, units, reference, chunk_size=11, progress=False)
    replayed = TapPrivatizer(3, replay=reference.outputs)
    run_local(protocol, replace_unit(units, j, {"x": -units["x"][j] * 1e3}), replayed, chunk_size=11, progress=False)
    rounds = [(r, b, a) for (r, b), (_, a) in zip(reference.values, replayed.values)]
    joint = rounds[0][0].params["joint_sensitivity"]
    dx = torch.stack([(a - b).double().flatten() for _, b, a in rounds])
    moved = float(torch.linalg.matrix_norm(C @ dx))
    assert 0.5 * joint < moved <= joint * (1 + 1e-9)
    cohort = int(protocol.cohort_of(torch.tensor([j])))
    assert all(float(dx[s].abs().max()) == 0.0 for s in range(cfg.steps) if s % 3 != cohort)


# ----- accounted adaptive clipping (Andrew et al. 2021) ---------------------------------------------
ADAPTIVE = {**SMALL, "clip_rule": "adaptive", "clip": 5.0, "clip_quantile": 0.5, "clip_lr": 0.5, "clip_budget": 0.2}


@pytest.mark.slow  # ~4 s; NoisyGD's adaptive-clip test below keeps counts-in-the-ledger in the default suite
@pytest.mark.parametrize("noise", ["independent", "banded"])
def test_adaptive_clip_count_is_a_release_in_the_ledger_and_in_the_total_epsilon(noise):
    cfg, protocol, units = setup({**ADAPTIVE, "noise": noise})
    privatizer = TapPrivatizer(3)
    state, _ = run_local(protocol, units, privatizer, chunk_size=40, progress=False)
    counts = [r for r in privatizer.ledger if r.name.endswith(".below")]
    assert len(counts) == cfg.rounds
    z = protocol.noise_multiplier
    for r in counts:
        assert r.sensitivity == 1.0 and r.noise_multiplier == pytest.approx(z / math.sqrt(0.2))
    grads = [r for r in privatizer.ledger if r.name.endswith(".G")]
    assert all(r.per_unit_bound == 1.0 for r in grads)  # G_j/C_t is released, scaled back by the public C_t
    # the bound moves with the released counts only: C_{t+1} = C_t·exp(−η(b̄ − γ)), b̄ over the public cohort size
    released = {r.name: out for (r, _), out in zip(privatizer.values, privatizer.outputs)}
    c = 5.0
    for t in range(1, cfg.rounds + 1):
        size = protocol.cohort_size(t)
        c *= math.exp(-0.5 * ((float(released[f"round{t}.below"]) + size / 2) / size - 0.5))
    assert float(state["clip"]) == pytest.approx(c, rel=1e-12)
    eps = ledger_epsilon(privatizer.ledger, cfg.delta, cfg.accountant)
    recomputed = event_epsilon(FedRepProtocol.user_event(z, protocol.releases_per_user(), 1.0, 0.2), cfg.delta)
    assert eps == pytest.approx(recomputed, rel=2e-3) and eps <= cfg.epsilon * (1 + 2e-3)
    # without the counts the same z would claim less: the counts are accounted, not free
    assert event_epsilon(FedRepProtocol.user_event(z / math.sqrt(0.8), 1 + 3), cfg.delta) < 0.97 * eps


@pytest.mark.slow  # ~8 s; NoisyGD's adaptive count neighbour test below stays in the default suite
def test_adaptive_clip_worst_case_neighbours_move_each_release_by_at_most_its_sensitivity():
    cfg, protocol, units = setup(ADAPTIVE)
    j = 27
    cohort = int(protocol.cohort_of(torch.tensor([j])))
    moved_count = 0.0
    for label in ("alternating y",):
        new = adversaries(units["x"][j], units["y"][j], torch.float64)[label]
        outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS, f"cohort:{cohort}"})
        moved_count = max([moved_count] + [c for r, c in outcome.changes if r.name.endswith(".below")])
    assert moved_count == 1.0  # a user's indicator flips: the count's full sensitivity is reached


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_a_checkpointed_privatizer_continues_the_same_correlated_stream(noise):
    """The recurrence's last b − 1 vectors (a BLT's buffers) travel in the Privatizer's state (what a resumed run loads)."""
    m = cc.mechanism("banded", 10, 4, 4)
    if noise == "blt":
        s = cc.Strategy("blt", (1.0,), (0.8, 0.3), (0.4, 0.1))
        m = cc.CorrelatedNoise(s, 10, cc.sensitivity(s.matrix(10), cc.cyclic_participation(10, 4)), 4)
    value = torch.zeros(3, dtype=torch.float64)

    def release(p: Privatizer, t: int) -> torch.Tensor:
        return p.correlated_gaussian_sum(
            value, per_unit_bound=1.0, noise_multiplier=1.0, noise=m, stream="G", step=t, name=f"r{t}", round=t + 1
        )

    whole = Privatizer(6)
    expected = [release(whole, t) for t in range(10)]
    first = Privatizer(6)
    for t in range(5):
        release(first, t)
    resumed = Privatizer(6)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(release(resumed, t), expected[t]) for t in range(5, 10))


@pytest.mark.slow  # ~25 s: the Flower grid
def test_cyclic_banded_adaptive_fedrep_on_the_flower_grid_matches_local(tmp_path):
    from fedpers.app import make_client_app
    from fedpers.runner import Runtime, RuntimeOptions, execute
    from tests.flower_support import InProcessGrid

    cfg = config.build(EXP.config_type, {**ADAPTIVE, "noise": "banded", "n_users": 90, "rounds": 5, "seed": 1})
    local = execute(EXP, cfg, out=tmp_path / "local", progress=False)
    grid = InProcessGrid(make_client_app(), 3)
    flower = execute(
        EXP, cfg, RuntimeOptions(runtime=Runtime.FLOWER, nodes=3), out=tmp_path / "flower", progress=False, grid=grid
    )
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    torch.testing.assert_close(flower["_state"]["U"], local["_state"]["U"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name, values", [("fedrep", ADAPTIVE), ("noisygd", {**GD_SMALL, "clip_rule": "adaptive"})])
def test_the_canary_audit_refuses_adaptive_clips(name, values):
    """Cycles and correlated noise are audited (tests/test_audit.py scores a stream on its decorrelated
    releases); a clip that moves with the data is not (the canaries sit at a fixed clip)."""
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    with pytest.raises(ValueError, match="audit"):
        exp.canary_design().protocol(cfg, 4)
    exp.canary_design().protocol(config.build(exp.config_type, {**values, "clip_rule": "fixed"}), 4)


# ----- NoisyHead (users' prompts, rounds mode for cohorts) -------------------------------------------
NH = EXPERIMENTS["noisyhead"]
NH_SMALL = dict(
    prompts=240,
    dim=3,
    steps=12,
    epsilon=5.0,
    calibration="accountant",
    chunk_size=50,
    unit="user",
    prompts_per_user=4,
    user_clip=0.2,
    test_prompts=50,
)


@pytest.mark.slow  # ~9 s: two NoisyHead runs
def test_noisyhead_correlated_noise_gives_the_same_gamma_in_both_modes_and_cycles_are_accounted():
    """The T steps draw one correlated stream in statistics and in rounds mode alike; cyclic cohorts
    (rounds mode) record each step for its cohort and calibrate to ⌈T/K⌉ steps per user."""
    from fedpers.runner import execute

    out = {}
    for mode in ("statistics", "rounds"):
        cfg = config.build(NH.config_type, {**NH_SMALL, "mode": mode, "noise": "banded", "bands": 3})
        out[mode] = execute(NH, cfg, write=False, progress=False)
    a, b = (torch.tensor(out[m]["Gamma"]) for m in ("statistics", "rounds"))
    assert float((a - b).abs().max()) <= 1e-6 * max(1.0, float(a.abs().max()))
    assert out["rounds"]["privacy"]["epsilon"] <= 5.0 * (1 + 2e-3)
    cfg = config.build(NH.config_type, {**NH_SMALL, "mode": "rounds", "cohorts": "cyclic", "cycle": 4})
    protocol = NH.protocol(cfg)
    assert protocol.participations() == 3 and protocol.step_divisor(1) == 15 * 4
    units = NH.units(cfg, torch.arange(60))
    privatizer = TapPrivatizer(1)
    run_local(protocol, units, privatizer, chunk_size=50, progress=False)
    assert [r.units for r in privatizer.ledger] == [f"cohort:{t % 4}" for t in range(12)]
    eps = ledger_epsilon(privatizer.ledger, cfg.delta, cfg.accountant)
    assert eps == pytest.approx(5.0, rel=2e-3) and eps <= 5.0 * (1 + 2e-3)
    with pytest.raises(ValueError, match="cohorts"):
        config.build(NH.config_type, {**NH_SMALL, "cohorts": "cyclic", "cycle": 4})  # statistics mode


@pytest.mark.parametrize("name", ["noisyhead", "noisygd"])
def test_cyclic_worst_case_neighbours_of_noisyhead_users_and_noisygd_examples_move_only_their_cohort(name):
    if name == "noisyhead":
        values = dict(
            prompts=60,
            dim=3,
            context=6,
            steps=5,
            epsilon=2.0,
            mode="rounds",
            unit="user",
            prompts_per_user=3,
            cohorts="cyclic",
            cycle=3,
        )
    else:
        values = {**GD_SMALL, "steps": 5}
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    protocol = exp.protocol(cfg)
    units = {k: v.clone() for k, v in exp.units(cfg, torch.arange(exp.num_units(cfg))).items()}
    j = 11
    cohort = int(protocol.cohort_of(torch.tensor([j])))
    y = units["y"][j] if name == "noisyhead" else None
    for label in ("huge x", "zero x"):
        new = adversaries(units["x"][j], y, torch.float64)[label]
        outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS, f"cohort:{cohort}"})
        assert outcome.releases == 5, label
        assert max(c for r, c in outcome.changes if r.units == f"cohort:{cohort}") > 0


@pytest.mark.parametrize("noise", ["independent", pytest.param("banded", marks=pytest.mark.slow)])
def test_noisygd_adaptive_clip_counts_are_accounted_and_move_by_at_most_their_sensitivity(noise):
    values = {
        **GD_SMALL,
        "noise": noise,
        "clip_rule": "adaptive",
        "grad_clip": 5.0,
        "clip_budget": 0.25,
        "clip_lr": 0.5,
    }
    cfg, protocol, units = gd_setup(values)
    privatizer = TapPrivatizer(2)
    state, _ = run_local(protocol, units, privatizer, chunk_size=11, progress=False)
    counts = [r for r in privatizer.ledger if r.name.endswith(".below")]
    assert len(counts) == cfg.steps and all(r.sensitivity == 1.0 for r in counts)
    summary = GD.privacy_summary(cfg, protocol, privatizer.ledger)
    assert summary["epsilon"] <= 2.0 * (1 + 2e-3) and summary["epsilon"] == pytest.approx(2.0, rel=2e-2)
    released = {r.name: out for (r, _), out in zip(privatizer.values, privatizer.outputs)}
    c = 5.0
    for s in range(cfg.steps):
        size = protocol.cohort_range(s % 3)[1] - protocol.cohort_range(s % 3)[0]
        c *= math.exp(-0.5 * ((float(released[f"step{s + 1}.below"]) + size / 2) / size - 0.5))
    assert float(state["clip"]) == pytest.approx(c, rel=1e-12)
    if noise == "independent":
        j = 4
        cohort = int(protocol.cohort_of(torch.tensor([j])))
        outcome = check_neighbour(protocol, units, j, {"x": -units["x"][j] * 1e3}, {ALL_UNITS, f"cohort:{cohort}"})
        assert max(ch for r, ch in outcome.changes if r.name.endswith(".below")) <= 1.0


def test_poisson_sampling_with_a_blt_is_refused_naming_noise_on_every_protocol_that_samples():
    """The amplified analysis covers banded C only: a Poisson-sampled BLT must not start (composing its
    rounds as sampled independent Gaussians would overstate its privacy); banded and optimised run amplified."""
    for exp, values in (
        (EXP, {**SMALL, "cohorts": "poisson", "cycle": 1, "sampling_rate": 0.25}),
        (GD, {**GD_SMALL, "cohorts": "poisson", "cycle": 1, "sampling_rate": 0.25}),
        (NH, {**NH_SMALL, "mode": "rounds", "sampling_rate": 0.5}),
    ):
        with pytest.raises(ValueError, match="noise: blt with cohorts poisson"):
            config.build(exp.config_type, {**values, "noise": "blt"})
        config.build(exp.config_type, {**values, "noise": "banded"})


@pytest.mark.parametrize("model", ["distributed", "local"])
def test_node_side_dp_refuses_correlated_noise_on_every_protocol_before_any_release(model):
    """Shares drawn per round cannot be correlated across rounds: unrefused, FedRep's correlated rounds
    were noised by the server on sums it saw, under a model that promises it never sees them."""
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.runner import resolve

    for exp, values in (
        (EXP, {**SMALL, "noise": "banded", "accountant": "rdp"}),
        (GD, {**GD_SMALL, "noise": "banded"}),
    ):
        cfg = config.build(exp.config_type, values)
        with pytest.raises(ValueError, match=f"dp_model {model} does not support .* with correlated noise"):
            resolve(exp, cfg, config.build(RuntimeOptions, {"nodes": 3, "dp_model": model}))
