"""Poisson-sampled Skellam (distributed DP with Poisson cohorts; docs/accounting.md, "Skellam with Poisson
cohorts"): the subsampled RDP bounds against an independent implementation, against the exact ε of the
sampled one-dimensional mixtures, and the nodes' own membership draws and noise through a real run."""

from __future__ import annotations

import math
from typing import Any

import dp_accounting
import mpmath
import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from fedpers import config
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.privacy import distributed as dist
from fedpers.privacy import skellam
from fedpers.privacy.accountant import event_epsilon, how_accounted, ledger_epsilon
from fedpers.privacy.ledger import Ledger, SkellamDpEvent
from fedpers.runner import resolve
from fedpers.runtime.local import run_local

DELTA = 1e-5
CONFIGS = [  # (V, Δ, q, rounds): 1-D integer pairs, Δ even (a replace-one pair is ±Δ/2 from absent)
    (16.0, 4, 0.1, 10),
    (100.0, 6, 0.05, 20),
    (4.0, 2, 0.2, 5),
]


# ----- an independent implementation: the two theorems term by term, in 60-digit arithmetic ---------
def _skellam_rdp(a: int, variance: float, l2: float, l1: float) -> Any:
    V, a_ = mpmath.mpf(variance), mpmath.mpf(a)
    return a_ * l2**2 / (2 * V) + min(((2 * a_ - 1) * l2**2 + 6 * l1) / (4 * V**2), 3 * mpmath.mpf(l1) / (2 * V))


def _zhu_wang(a: int, q: float, eps: Any) -> Any:
    """Zhu & Wang 2019, the general Poisson-subsampled bound (add/remove)."""
    q_ = mpmath.mpf(q)
    total = (1 - q_) ** (a - 1) * (a * q_ - q_ + 1) + mpmath.binomial(a, 2) * q_**2 * (1 - q_) ** (
        a - 2
    ) * mpmath.e ** eps(2)
    for ell in range(3, a + 1):
        total += 3 * mpmath.binomial(a, ell) * (1 - q_) ** (a - ell) * q_**ell * mpmath.e ** ((ell - 1) * eps(ell))
    return min(mpmath.log(total) / (a - 1), eps(a))


def _wang_balle_kasiviswanathan(a: int, q: float, eps: Any) -> Any:
    """Wang, Balle & Kasiviswanathan 2019, Theorem 9, with ε(∞) = ∞ (replace-one)."""
    q_ = mpmath.mpf(q)
    e2 = mpmath.e ** eps(2)
    total = 1 + q_**2 * mpmath.binomial(a, 2) * min(4 * (e2 - 1), 2 * e2)
    for j in range(3, a + 1):
        total += q_**j * mpmath.binomial(a, j) * mpmath.e ** ((j - 1) * eps(j)) * 2
    return min(mpmath.log(total) / (a - 1), eps(a))


@pytest.mark.parametrize(
    ("variance", "l2", "l1", "q"), [(100.0, 6.0, 18.0, 0.05), (16.0, 4.0, 4.0, 0.1), (2500.0, 40.0, 160.0, 0.01)]
)
def test_sampled_skellam_rdp_equals_an_independent_implementation(variance, l2, l1, q):
    """Both relations' curves equal the theorems computed term by term at 60 digits (orders 2..64), and the
    ε of 30 sampled rounds equals dp-accounting's conversion of the independent curve."""
    mpmath.mp.dps = 60
    orders = list(range(2, 65))
    inner = SkellamDpEvent(variance, l2, l1)

    def eps(a: int) -> Any:
        return _skellam_rdp(a, variance, l2, l1)

    for relation, theorem in (("add-remove", _zhu_wang), ("replace-one", _wang_balle_kasiviswanathan)):
        ours = skellam.poisson_sampled_rdp(inner, q, orders, relation)
        independent = np.array([float(theorem(a, q, eps)) for a in orders])
        np.testing.assert_allclose(ours, independent, rtol=1e-10)
        expected, _ = rdp_privacy_accountant.compute_epsilon(orders, list(30 * independent), DELTA)
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, inner), 30)
        assert skellam.rdp_epsilon(event, DELTA, orders, relation) == pytest.approx(expected, rel=1e-10)


def _exact_epsilon(variance: float, upper_shift: int, lower_shift: int, q: float, rounds: int) -> float:
    """ε at DELTA of ``rounds`` compositions of the pair (1 − q)Sk + q·Sk(· − upper) against (1 − q)Sk +
    q·Sk(· − lower), both directions, from the explicit PMFs (dp-accounting's PLD, pessimistic)."""
    reach = int(14 * math.sqrt(variance)) + 2 * max(abs(upper_shift), abs(lower_shift)) + 20
    k = np.arange(-reach, reach + 1)

    def mixture(shift: int) -> np.ndarray:
        return (1 - q) * stats.skellam.pmf(k, variance / 2, variance / 2) + q * stats.skellam.pmf(
            k - shift, variance / 2, variance / 2
        )

    def log_pmf(p: np.ndarray) -> dict[int, float]:
        return {int(x): math.log(v) for x, v in zip(k, p, strict=True) if v > 0}

    a, b = mixture(upper_shift), mixture(lower_shift)
    worst = 0.0
    for upper, lower in ((a, b), (b, a)):
        pld = privacy_loss_distribution.from_two_probability_mass_functions(
            log_pmf(lower), log_pmf(upper), value_discretization_interval=1e-4
        )
        worst = max(worst, pld.self_compose(rounds).get_epsilon_for_delta(DELTA))
    return worst


@pytest.mark.parametrize(("variance", "shift", "q", "rounds"), CONFIGS)
def test_sampled_skellam_epsilon_is_never_below_the_exact_epsilon_of_the_sampled_pair(variance, shift, q, rounds):
    """The 1-D worst-case pairs of a unit c̃ = Δ/2 from absent: replace-one (−c̃ against +c̃, recorded Δ₂ =
    Δ₁ = Δ) and add-remove (c̃ against absent, recorded Δ₂ = Δ₁ = c̃), Poisson-sampled at q and composed over
    the rounds. The accounted ε is an upper bound of the exact one (and sampling does amplify: below the
    unsampled ε)."""
    c = shift // 2
    cases = (
        ("replace-one", SkellamDpEvent(variance, shift, shift), _exact_epsilon(variance, -c, c, q, rounds)),
        ("add-remove", SkellamDpEvent(variance, c, c), _exact_epsilon(variance, c, 0, q, rounds)),
    )
    for relation, inner, exact in cases:
        sampled = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, inner), rounds)
        accounted = event_epsilon(sampled, DELTA, neighbours=relation)
        assert exact <= accounted, (relation, exact, accounted)
        unsampled = event_epsilon(dp_accounting.SelfComposedDpEvent(inner, rounds), DELTA, neighbours=relation)
        assert accounted < unsampled


def test_subsampled_bound_grows_with_the_rate_and_is_the_plain_curve_at_one():
    inner = SkellamDpEvent(400.0, 10.0, 30.0)
    for relation in ("replace-one", "add-remove"):
        curves = [skellam.poisson_sampled_rdp(inner, q, neighbours=relation) for q in (0.001, 0.01, 0.1, 0.5, 1.0)]
        for low, high in zip(curves, curves[1:], strict=False):
            assert np.all(low <= high + 1e-15)
        np.testing.assert_array_equal(curves[-1], skellam.event_rdp(inner, neighbours=relation))
    with pytest.raises(ValueError, match="sampling_probability must be in"):
        skellam.poisson_sampled_rdp(inner, 0.0)


# ----- through a run: the nodes draw the sample, record it, and add the recorded noise ----------------
POISSON = dict(n_users=400, dim=5, rank=2, samples_per_user=16, rounds=3, baselines="none", epsilon=2.0)


def _resolved(**options: object) -> Any:
    cfg = config.build(AltMinConfig, {**POISSON, "cohorts": "poisson", "sampling_rate": 0.25})
    return resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, {"nodes": 4, **options}))


def test_distributed_poisson_altmin_records_sampled_skellam_within_its_target():
    p = _resolved(dp_model="distributed", bits=16)
    assert not any(e.psd for e in p.privatizer.plan.encodings.values())  # sampled: A is not PSD-tightened
    run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    sampled = [r for r in p.privatizer.ledger if r.round > 0]
    assert sampled and all(isinstance(r.event, dp_accounting.PoissonSampledDpEvent) for r in sampled)
    assert all(r.event.sampling_probability == 0.25 and isinstance(r.event.event, SkellamDpEvent) for r in sampled)
    assert all(r.params["poisson_sample"] == f"round{r.round}" for r in sampled)
    assert 0.97 * 2.0 <= ledger_epsilon(p.privatizer.ledger, DELTA) <= 2.0
    again = Ledger.from_json(p.privatizer.ledger.to_json())  # ledger.json keeps the sampled events
    assert again == p.privatizer.ledger and ledger_epsilon(again, DELTA) == ledger_epsilon(p.privatizer.ledger, DELTA)
    assert all(math.isfinite(r.noise_multiplier) for r in sampled)  # `fedpers privacy` prints each one's z
    named = how_accounted(p.privatizer.ledger, "pld")  # what every view prints
    assert named["accountant"] == "rdp" and "Wang, Balle & Kasiviswanathan 2019" in named["composition"]


def test_the_nodes_draw_the_sample_whatever_the_server_sends():
    """The membership the nodes use is their own draw: the server's broadcast ``sampled`` (everyone, or no
    one) changes nothing they send; the number who took part is ≈ q·n."""
    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round

    p = _resolved(dp_model="distributed", bits=16)
    source = UnitSource.of({k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(400)).items()})
    U = torch.linalg.qr(torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    got = [
        node_round(p.protocol, 1, {"U": U, "sampled": server}, source, p.privatizer)
        for server in (torch.ones(400, dtype=torch.float64), torch.zeros(400, dtype=torch.float64))
    ]
    for name in got[0].modular:
        assert torch.equal(got[0].modular[name], got[1].modular[name])
    assert 60 <= got[0].taking_part <= 140  # Binomial(400, 0.25): 100 ± 6σ (the nodes' own count, not released)
    ids = torch.arange(400)
    mine = dist.node_membership(p.privatizer.noise_seed, 1, ids, 0.25, secure=False)
    assert got[0].taking_part == int(mine.sum()) and got[0].count == 400  # the server's count: the plan's


def test_sampled_release_noise_is_the_recorded_variance():
    """The noise that reaches a sampled round's sum is the ledger's Skellam variance: the same round (same
    members, same rounding) with the nodes' shares and with zero-variance shares differ by the summed shares
    alone, so their difference over √V has variance 1 (a share halved gives 0.5, outside the band)."""
    import dataclasses

    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round

    p = _resolved(dp_model="distributed", bits=20)
    plan = p.privatizer.plan
    source = UnitSource.of({k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(400)).items()})
    U = torch.linalg.qr(torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    silent = dataclasses.replace(
        plan, encodings={k: dataclasses.replace(e, variance=0.0) for k, e in plan.encodings.items()}
    )
    quiet = dist.DistributedPrivatizer(p.privatizer.noise_seed, silent)
    z = []
    for seed in range(8):
        p.privatizer.noise_seed = quiet.noise_seed = seed
        noisy = node_round(p.protocol, 1, {"U": U, "sampled": torch.ones(400)}, source, p.privatizer).modular
        clean = node_round(p.protocol, 1, {"U": U, "sampled": torch.ones(400)}, source, quiet).modular
        for name, enc in plan.encodings.items():
            if name in noisy:
                recorded = enc.event(plan.nodes, plan.min_nodes).variance
                diff = dist.centered(noisy[name] - clean[name], enc.bits).double()
                z.append(diff / math.sqrt(recorded))
    ratio = float(torch.cat(z).var())
    assert 0.8 < ratio < 1.25, ratio


@pytest.mark.parametrize("cohorts", [{}, {"cohorts": "poisson", "sampling_rate": 0.25}])
def test_distributed_add_remove_records_one_units_rounded_vector_as_its_sensitivity(cohorts):
    """--neighbours add-remove under distributed DP: every release names the relation and records Δ₂ = c̃,
    Δ₁ = c̃·min(√D, c̃) (one unit's rounded vector, never PSD-tightened), V = (z·c̃)² (σ = z·c̃, as central's
    σ = z·B), and the ledger's ε by the relation's accountant meets the target (sampled: Zhu & Wang)."""
    cfg = config.build(AltMinConfig, {**POISSON, "neighbours": "add-remove", **cohorts})
    p = resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed"}))
    plan = p.privatizer.plan
    run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    for r in p.privatizer.ledger:
        enc = plan.encodings[r.params["statistic"]]
        inner = r.event.event if isinstance(r.event, dp_accounting.PoissonSampledDpEvent) else r.event
        assert r.neighbours == "add-remove" and not enc.psd
        assert inner.l2_sensitivity == pytest.approx(enc.rounded_bound)
        assert inner.l1_sensitivity == pytest.approx(enc.rounded_bound * min(math.sqrt(enc.padded), enc.rounded_bound))
        assert inner.variance == pytest.approx((plan.noise_multiplier * enc.rounded_bound) ** 2)
    assert 0.97 * 2.0 <= ledger_epsilon(p.privatizer.ledger, DELTA) <= 2.0
    if cohorts:
        assert "Zhu & Wang 2019" in how_accounted(p.privatizer.ledger, "pld")["composition"]
    with pytest.raises(ValueError, match="runs on the local runtime only"):
        resolve(
            AltMinExperiment(),
            cfg,
            config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "runtime": "flower"}),
        )


def test_poisson_cohorts_are_refused_where_the_nodes_cannot_draw_them():
    with pytest.raises(ValueError, match="dp_model local does not support Poisson sampling"):
        _resolved(dp_model="local")
    with pytest.raises(ValueError, match="dp_model local does not support Poisson sampling"):
        _resolved(dp_model="local", runtime="flower")
    # Flower's nodes draw their own memberships (tests/test_poisson_flower.py); no count of theirs travels
    assert _resolved(dp_model="distributed", runtime="flower").privatizer.plan.bits >= 4
    enc = dist.StatEncoding("A", (4, 4), True, 1.0, 10.0, 11.0, 1.0, 16, 0, psd=True)
    mapped = dist.skellam_event(
        lambda z: dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(z)), [enc]
    )
    with pytest.raises(ValueError, match="PSD-tightened"):
        mapped(1.0)


def test_huge_and_non_finite_float32_units_move_a_sampled_release_by_at_most_one_sensitivity_each():
    """float32 units at 1e38, inf or nan in a sampled distributed round (each a sampled unit): an inf or nan unit
    is zeroed and counted (the round's ``zeroed``), its row exactly the one a unit of zeros gives, so nothing else
    of the sum changes; a 1e38 unit is clipped to its bound. Either way the modular sum moves from the clean
    data's by at most the recorded Δ₂ per bad unit (a scale or a clip that let 1e38 through would not)."""
    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round

    cfg = config.build(AltMinConfig, {**POISSON, "cohorts": "poisson", "sampling_rate": 0.25, "dtype": "float32"})
    opts = config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "bits": 16})
    p = resolve(AltMinExperiment(), cfg, opts)
    plan = p.privatizer.plan
    clean = p.experiment.units(p.cfg, torch.arange(400))
    assert clean["x"].dtype == torch.float32
    taking = dist.node_membership(p.privatizer.noise_seed, 1, torch.arange(400), 0.25, secure=False)
    huge, infinite, missing = taking.nonzero().squeeze(1)[:3].tolist()
    U = torch.linalg.qr(torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]

    def round_on(changes: dict[tuple[str, int], float]) -> Any:
        units = {k: v.clone() for k, v in clean.items()}
        for (key, unit), value in changes.items():
            units[key][unit] = value
        server = torch.zeros(400, dtype=torch.float64)  # the nodes draw their own sample whatever this says
        return node_round(p.protocol, 1, {"U": U, "sampled": server}, UnitSource.of(units), p.privatizer)

    base = round_on({})
    bad = {("x", huge): 1e38, ("x", infinite): math.inf, ("y", missing): math.nan}
    for change, zeroed in zip(bad.items(), (0, 1, 1), strict=True):
        got = round_on(dict([change]))
        assert (got.count, got.zeroed) == (base.count, zeroed)
        moved = {
            name: float(dist.centered(got.modular[name] - base.modular[name], enc.bits).double().norm())
            for name, enc in plan.encodings.items()
            if name in got.modular
        }
        assert moved and all(moved[name] <= plan.encodings[name].l2_sensitivity for name in moved), (change, moved)
        assert max(moved.values()) > 0, change  # the unit was in the sample: the sum moved
    together = round_on(bad)
    blanked = round_on(
        {("x", huge): 1e38, ("x", infinite): 0.0, ("y", infinite): 0.0, ("x", missing): 0.0, ("y", missing): 0.0}
    )
    assert (together.count, together.zeroed) == (base.count, 2)
    for name in together.modular:
        assert torch.equal(together.modular[name], blanked.modular[name])


def test_rdp_with_poisson_cohorts_is_refused_naming_what_the_flag_does_under_each_trust_model():
    """The refusal is true under distributed DP too: the flag does not account the Skellam releases (subsampled
    RDP does, whatever it names), but it calibrates the central multiplier the nodes' plan starts from."""
    with pytest.raises(ValueError, match="accountant must be pld with cohorts poisson") as refused:
        config.build(AltMinConfig, {**POISSON, "cohorts": "poisson", "sampling_rate": 0.25, "accountant": "rdp"})
    assert "--dp-model distributed the nodes' sampled Skellam releases are accounted by subsampled RDP" in str(
        refused.value
    )
    assert "calibrates only the central noise multiplier" in str(refused.value)
