"""Amplified banded matrix factorization (Choquette-Choo et al. 2023, Theorem 4) for Poisson cohorts: the
ledger's ε against jax_privacy's ``amplified_bandmf_event`` and an independent computation, never below a
Monte Carlo lower estimate of the mechanism's own privacy loss (which catches a wrong noise scale), the
strategies chosen for the sampled participation, the runs' ledgers, worst-case neighbours and refusals."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import stats

from fedpers import config
from fedpers.config import Neighbours
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import ALL_UNITS, Privatizer, ledger_epsilon
from fedpers.privacy import correlated as cc
from fedpers.privacy.accountant import RELATIONS
from fedpers.runtime.local import run_local
from tests.neighbours import check_neighbour

CONFIGS = [  # (T, b groups = bands, q within a group, z); the first two take ~5-10 s each on a busy machine
    pytest.param(16, 4, 0.5, 1.0, marks=pytest.mark.slow),
    pytest.param(64, 8, 0.25, 0.8, marks=pytest.mark.slow),
    (100, 4, 0.1, 2.0),  # T not a multiple of b: the first group takes ⌈T/b⌉ = 25 rounds
]


def amplified_ledger(T: int, b: int, q: float, z: float, neighbours: str = "replace-one", kind: str = "banded"):
    """The ledger of a T-round amplified stream at multiplier z, released through the real Privatizer."""
    noise = cc.amplified_mechanism(kind, T, b, q)
    p = Privatizer(0, neighbours=neighbours)
    for t in range(T):
        p.correlated_gaussian_sum(
            torch.zeros(3, dtype=torch.float64),
            per_unit_bound=1.0,
            noise_multiplier=z,
            noise=noise,
            stream="g",
            step=t,
            name=f"g{t}",
            round=t + 1,
        )
    return noise, p.ledger


def independent_epsilon(T: int, b: int, q: float, z: float, delta: float, neighbours: str) -> float:
    """dp-accounting's PLD built directly (no DpEvent, no ledger): ⌈T/b⌉-fold sampled Gaussian."""
    one = pld_lib.from_gaussian_mechanism(
        z, sampling_prob=q, value_discretization_interval=1e-4, neighboring_relation=RELATIONS[Neighbours(neighbours)]
    )
    return float(one.self_compose(-(-T // b)).get_epsilon_for_delta(delta))


@pytest.mark.parametrize("neighbours", ["replace-one", "add-remove"])
@pytest.mark.parametrize("T, b, q, z", CONFIGS)
def test_amplified_epsilon_equals_jax_privacys_and_an_independent_pld(T, b, q, z, neighbours):
    noise, ledger = amplified_ledger(T, b, q, z, neighbours)
    assert {r.units for r in ledger} == {f"cohort:{g}" for g in range(b)}
    assert sum(r.units == "cohort:0" for r in ledger) == -(-T // b)
    eps = ledger_epsilon(ledger, 1e-6)
    assert eps == pytest.approx(independent_epsilon(T, b, q, z, 1e-6, neighbours), rel=1e-6)
    jp = pytest.importorskip("jax_privacy.experimental.accounting")
    event = jp.amplified_bandmf_event(z, T, num_bands=b, sampling_prob=q)
    theirs = dp_accounting.pld.PLDAccountant(RELATIONS[Neighbours(neighbours)]).compose(event).get_epsilon(1e-6)
    assert eps == pytest.approx(theirs, rel=1e-6)


@pytest.mark.slow  # 15-40 s each: prv-accountant at this accuracy
@pytest.mark.parametrize("T, b, q, z", [(16, 4, 0.5, 1.0), (64, 8, 0.25, 0.8)])
def test_amplified_epsilon_within_prv_accountants_bounds(T, b, q, z):
    """prv-accountant (Gopi, Lee & Wutschitz 2021), a separate numerical method: its certified interval."""
    prv = pytest.importorskip("prv_accountant")
    _, ledger = amplified_ledger(T, b, q, z, "add-remove")
    eps = ledger_epsilon(ledger, 1e-6)
    acc = prv.PRVAccountant(
        prvs=[prv.PoissonSubsampledGaussianMechanism(noise_multiplier=z, sampling_probability=q)],
        max_self_compositions=[-(-T // b)],
        eps_error=1e-4,
        delta_error=1e-10,
    )
    lo, _, hi = acc.compute_epsilon(delta=1e-6, num_self_compositions=[-(-T // b)])
    assert lo - 1e-4 <= eps <= hi + 1e-4


# ----- Monte Carlo: the mechanism's own privacy loss, sampled --------------------------------------
def mc_epsilon_lower(
    C: torch.Tensor,
    sigma: float,
    clip: float,
    q: float,
    groups: int,
    delta: float,
    neighbours: str,
    samples: int = 200_000,
    confidence: float = 0.999,
    seed: int = 0,
) -> float:
    """A lower confidence bound on the true ε(δ) of releasing Cx + σz over T rounds, for the worst unit of
    group 0 (aligned contributions at the clip in every round it is sampled in, each sampled with q) against
    its neighbour (absent, or the opposite contribution under replace-one). The 2^P-component mixture is
    evaluated in the full T dimensions (no use of the banded structure); both directions of the hockey stick,
    δ̂(ε) = E_P[(1 − e^(ε − L))₊] with L = log p/q, minus its standard error times the quantile."""
    g = torch.Generator().manual_seed(seed)
    T = C.shape[0]
    rounds = list(range(0, T, groups))
    P = len(rounds)
    cols = C[:, rounds].double() * clip  # (T, P)
    subsets = torch.tensor(list(itertools.product((0.0, 1.0), repeat=P)), dtype=torch.float64)  # (2^P, P)
    means = subsets @ cols.T  # (2^P, T)
    logw = subsets.sum(1) * math.log(q) + (P - subsets.sum(1)) * math.log1p(-q)

    def log_density(y: torch.Tensor, sign: float | None) -> torch.Tensor:
        if sign is None:  # absent: N(0, σ²I), up to the constant shared by every density here
            return -(y**2).sum(1) / (2 * sigma**2)
        d = y[:, None, :] - sign * means[None]
        return torch.logsumexp(logw[None] - (d**2).sum(2) / (2 * sigma**2), dim=1)

    def draw(sign: float | None, n: int) -> torch.Tensor:
        y = sigma * torch.randn(n, T, generator=g, dtype=torch.float64)
        if sign is None:
            return y
        pick = (torch.rand(n, P, generator=g, dtype=torch.float64) < q).double()
        return y + sign * pick @ cols.T

    pairs = [(1.0, None), (None, 1.0)] if neighbours == "add-remove" else [(1.0, -1.0)]
    zq = stats.norm.ppf(confidence)
    best = 0.0
    for first, second in pairs:
        losses = []
        for _ in range(samples // 20_000):
            y = draw(first, 20_000)
            losses.append(log_density(y, first) - log_density(y, second))
        L = torch.cat(losses)

        def delta_lower(eps: float) -> float:
            terms = (1 - torch.exp(eps - L)).clamp_min(0)
            return float(terms.mean()) - zq * float(terms.std()) / math.sqrt(L.numel())

        lo, hi = 0.0, 50.0
        if delta_lower(lo) <= delta:
            continue
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if delta_lower(mid) > delta else (lo, mid)
        best = max(best, lo)
    return best


GD = EXPERIMENTS["noisygd"]
GD_SMALL = dict(
    examples=48,
    classes=3,
    feature_dim=5,
    steps=8,
    epsilon=2.0,
    test_examples=20,
    baselines="none",
    dtype="float64",
    collapse="random",
    beta=0.3,
    cohorts="poisson",
    sampling_rate=0.25,
    noise="banded",
    bands=2,
)


@pytest.mark.parametrize("neighbours", ["replace-one", "add-remove"])
def test_the_amplified_stream_is_never_below_the_monte_carlo_lower_estimate_and_a_halved_scale_is_caught(neighbours):
    """The Privatizer's own amplified stream (8 rounds, 2 groups sampled at 0.5, 2 bands, z = 1) at δ = 1e-2."""
    noise, ledger = amplified_ledger(8, 2, 0.5, 1.0, neighbours)
    C, sigma = noise.strategy.matrix(8), ledger.releases[0].noise_std
    accounted = ledger_epsilon(ledger, 1e-2)
    lower = mc_epsilon_lower(C, sigma, 1.0, 0.5, 2, 1e-2, neighbours, samples=100_000)
    assert 0.9 * accounted <= lower <= accounted  # tight (the bound is exact here) and never above
    assert mc_epsilon_lower(C, sigma / 2, 1.0, 0.5, 2, 1e-2, neighbours, samples=100_000) > 2 * accounted


@pytest.mark.slow  # 20-40 s each: a NoisyGD run's calibration and 8 Monte Carlo estimates
@pytest.mark.parametrize("neighbours", ["replace-one", "add-remove"])
def test_a_runs_amplified_epsilon_is_never_below_the_monte_carlo_lower_estimate_and_a_halved_scale_is_caught(
    neighbours,
):
    cfg = config.build(GD.config_type, {**GD_SMALL, "neighbours": neighbours})
    protocol = GD.protocol(cfg)
    noise = protocol.correlated
    assert noise is not None and noise.amplified and (noise.cycle, noise.sampling_rate) == (2, 0.5)
    privatizer = Privatizer(1, neighbours=neighbours)
    run_local(protocol, GD.units(cfg, torch.arange(cfg.examples)), privatizer, progress=False)
    sigma = privatizer.ledger.releases[0].noise_std
    assert sigma == pytest.approx(protocol.noise_std()) and len(privatizer.ledger) == cfg.steps
    C = noise.strategy.matrix(cfg.steps)
    for delta in (1e-2, 1e-3):
        accounted = ledger_epsilon(privatizer.ledger, delta)
        lower = mc_epsilon_lower(C, sigma, cfg.grad_clip, noise.sampling_rate, noise.cycle, delta, neighbours)
        assert lower <= accounted
        assert lower >= 0.75 * accounted  # the estimate is close: it could catch a real gap
        # the same mechanism with half the noise (a sensitivity halved in the noise scale) is caught
        assert (
            mc_epsilon_lower(C, sigma / 2, cfg.grad_clip, noise.sampling_rate, noise.cycle, delta, neighbours)
            > accounted
        )


# ----- strategies chosen for the sampled participation ----------------------------------------------
def test_the_chosen_groups_minimise_the_runs_error_and_are_never_worse_than_independent_poisson():
    T, q = 16, 1 / 16

    def z_of(b: int) -> float:  # a noise multiplier that saturates with b (as amplification does at small z)
        return 0.7 * b**0.3

    chosen = cc.sampled_mechanism("optimised", T, 0, q, z_of)
    errors = {
        b: cc.error(
            cc.poisson_independent(T, q) if b == 1 else cc.amplified_mechanism("optimised", T, b, min(1.0, q * b)),
            z_of(b),
        )
        for b in cc.sampled_groups(q, T)
    }
    assert cc.sampled_groups(q, T) == [1, 2, 4, 8, 16]
    assert chosen.cycle == min(errors, key=errors.get) > 1 and cc.error(chosen, z_of(chosen.cycle)) == pytest.approx(
        min(errors.values())
    )
    assert min(errors.values()) < errors[1] and "chose" in chosen.note and not chosen.warning
    # the optimised amplified strategy beats the square root on its own (single-participation) loss
    single = cc.single_participation(T)
    opt = cc.amplified_mechanism("optimised", T, 4, 0.25).strategy.toeplitz_coefficients(T)
    sqrt = cc.amplified_mechanism("banded", T, 4, 0.25).strategy.toeplitz_coefficients(T)
    assert float(cc.loss(opt, T, single)) < float(cc.loss(sqrt, T, single))
    # a given bands worse than independent Poisson noise is said, never silent
    worse = cc.sampled_mechanism("banded", T, 16, q, lambda b: 3.0 * b**0.5)
    assert "bands 0 chooses b" in worse.warning


def test_scope_of_each_strategys_sensitivity_is_stated():
    assert "any participation at least 4 rounds apart" in cc.run_mechanism("banded", 16, 4, 4).sensitivity.scope
    assert "fixed 4-cycle only" in cc.run_mechanism("banded", 16, 8, 4).sensitivity.scope
    assert "block-cyclic Poisson" in cc.amplified_mechanism("banded", 16, 4, 0.5).sensitivity.scope


def test_banded_worse_than_independent_noise_is_warned_in_the_result():
    """Every user every round, 8 bands of the square root over 16 rounds: 1.68× the error of independent noise."""
    noise = cc.run_mechanism("banded", 16, 8, 1)
    assert noise.warning.startswith("noise banded (8 bands, cycle 1): 1.683×")
    assert not cc.run_mechanism("optimised", 16, 8, 1).warning
    from fedpers.runner import execute

    fedrep = EXPERIMENTS["fedrep"]
    values = dict(
        n_users=40,
        dim=6,
        rank=2,
        samples_per_user=5,
        refit_samples=3,
        test_samples=10,
        rounds=16,
        epsilon=2.0,
        clip=1.0,
        baselines="none",
        noise="banded",
        bands=8,
    )
    result = execute(fedrep, config.build(fedrep.config_type, values), write=False, progress=False)
    assert any(w["metric"] == "noise" and "1.683×" in w["text"] for w in result["warnings"])


def test_blt_buffers_are_the_fewest_the_optimiser_needs():
    theta, omega = cc.chosen_blt(16, 4)
    patterns = cc.cyclic_participation(16, 4)
    losses = []
    for buffers in range(1, 5):
        t, w = cc.optimised_blt(16, buffers, 4)
        coefs = cc.blt_coefficients(torch.tensor(t, dtype=torch.float64), torch.tensor(w, dtype=torch.float64), 16)
        losses.append(float(cc.loss(coefs, 16, patterns)))
    keep = next(i + 1 for i, v in enumerate(losses) if v <= min(losses) * (1 + cc.BLT_TOLERANCE))
    assert len(theta) == keep == 1  # 4 buffers found no better loss than 1 (within 1e-6)
    assert cc.run_mechanism("blt", 16, 0, 4).strategy.buffers == 1


# ----- runs ---------------------------------------------------------------------------------------
FEDREP = EXPERIMENTS["fedrep"]
SMALL = dict(
    n_users=40,
    dim=6,
    rank=2,
    samples_per_user=5,
    refit_samples=3,
    test_samples=10,
    rounds=8,
    epsilon=2.0,
    clip=1.0,
    baselines="none",
    cohorts="poisson",
    sampling_rate=0.25,
    noise="banded",
    bands=2,
)


def test_a_poisson_banded_fedrep_run_is_accounted_per_group_and_meets_its_target():
    cfg = config.build(FEDREP.config_type, SMALL)
    protocol = FEDREP.protocol(cfg)
    assert (protocol.cycle, protocol.sampling_rate, protocol.releases_per_user()) == (2, 0.5, 5)
    privatizer = Privatizer(3)
    run_local(protocol, FEDREP.units(cfg, torch.arange(cfg.n_users)), privatizer, progress=False)
    units = [r.units for r in privatizer.ledger]
    assert units == [ALL_UNITS] + [f"cohort:{t % 2}" for t in range(8)]
    assert all(isinstance(r.event, dp_accounting.PoissonSampledDpEvent) for r in privatizer.ledger.releases[1:])
    summary = FEDREP.privacy_summary(cfg, protocol, privatizer.ledger)
    assert 2.0 * (1 - 2e-3) <= summary["epsilon"] <= 2.0
    assert summary["groups"] == 2 and "block-cyclic" in summary["sampling"]


def test_a_user_of_a_sampled_group_moves_only_its_groups_releases_by_at_most_their_sensitivity():
    cfg = config.build(FEDREP.config_type, {**SMALL, "clip": 0.05})  # 2 groups, each sampled at 0.5 in its rounds
    protocol = FEDREP.protocol(cfg)
    units = {k: v.clone() for k, v in FEDREP.units(cfg, torch.arange(cfg.n_users)).items()}
    j = 5  # sampled in each of its group's four rounds with this seed
    group = int(protocol.cohort_of(torch.tensor([j])))
    units["y"][j] = units["y"][j] * 1e3
    outcome = check_neighbour(
        protocol, units, j, {"x": torch.zeros_like(units["x"][j])}, {ALL_UNITS, f"cohort:{group}"}
    )
    moved = [m / r.sensitivity for r, m in outcome.changes if r.units == f"cohort:{group}"]
    assert len(moved) == 4 and max(moved) > 0.4  # at the clip where sampled: clip of Δ = 2·clip·‖c‖ (‖c‖ = 1.118)


def test_secure_noise_runs_correlated_noise_with_the_same_accounting(tmp_path):
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.runner import execute

    values = {**SMALL, "cohorts": "cyclic", "cycle": 2, "sampling_rate": 1.0}
    cfg = config.build(FEDREP.config_type, values)
    plain = execute(FEDREP, cfg, write=False, progress=False)
    secure = execute(FEDREP, cfg, RuntimeOptions(secure_noise=True), out=tmp_path / "run", progress=False)
    assert secure["privacy"]["epsilon"] == pytest.approx(plain["privacy"]["epsilon"], rel=1e-12)
    assert math.isfinite(secure["population_mse"])


def test_a_refused_combination_releases_nothing(tmp_path):
    """Refused before the first release: no ledger entry, no run directory, nothing charged."""
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.runner import execute

    with pytest.raises(ValueError, match="noise: blt with cohorts poisson"):
        config.build(FEDREP.config_type, {**SMALL, "noise": "blt", "bands": 0})
    cfg = config.build(FEDREP.config_type, {**SMALL, "neighbours": "add-remove", "accountant": "pld"})
    with pytest.raises(ValueError, match="neighbours add-remove needs dp_model central or distributed"):
        execute(
            FEDREP,
            cfg,
            config.build(RuntimeOptions, {"nodes": 2, "dp_model": "local"}),
            out=tmp_path / "r",
            progress=False,
        )
    assert not (tmp_path / "r").exists()
