"""Distributed and local DP (docs/privacy.md, "Three trust models"): the transforms, conditional
rounding at its bound, the modular sum, the Skellam accounting against the exact privacy loss of
two explicit PMFs, and whole AltMin / FedRep runs under each trust model."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import scipy.linalg
import torch
from scipy import signal, stats

from fedpers import config
from fedpers.config import DpModel
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.experiments.fedrep import FedRepConfig, FedRepExperiment
from fedpers.privacy import distributed as dist
from fedpers.privacy import skellam
from fedpers.privacy.accountant import ledger_epsilon
from fedpers.privacy.ledger import Ledger, SkellamDpEvent
from fedpers.runner import resolve
from fedpers.runtime.distributed import run_local_nodes
from fedpers.runtime.driver import RoundFailed
from fedpers.runtime.local import run_local


# ----- transforms ---------------------------------------------------------------------------------
def test_hadamard_is_the_orthonormal_walsh_hadamard_matrix_and_rotation_inverts():
    for D in (1, 2, 8, 64):
        x = torch.randn(3, D, dtype=torch.float64)
        H = torch.from_numpy(scipy.linalg.hadamard(D).astype(np.float64)) / math.sqrt(D)
        torch.testing.assert_close(dist.hadamard(x), x @ H.T, rtol=0, atol=1e-12)
    x = torch.randn(5, 37, dtype=torch.float64)
    y = dist.rotate(x, seed=11, D=64)
    torch.testing.assert_close(torch.linalg.vector_norm(y, dim=1), torch.linalg.vector_norm(x, dim=1))
    torch.testing.assert_close(dist.unrotate(y, 11, 37), x, rtol=0, atol=1e-12)
    assert not torch.allclose(dist.unrotate(y, 12, 37), x)  # the seed is the rotation


def test_flatten_keeps_the_upper_triangle_and_mirrors_it_back():
    a = torch.randn(4, 4, dtype=torch.float64)
    s = a + a.T
    v = dist.flatten(s.unsqueeze(0), (4, 4), True)
    assert v.shape == (1, 10)
    assert float(torch.linalg.vector_norm(v)) <= float(torch.linalg.matrix_norm(s)) + 1e-12
    torch.testing.assert_close(dist.unflatten(v[0], (4, 4), True), s)


# ----- conditional rounding -----------------------------------------------------------------------
def adversarial_at_the_bound(c: float, D: int) -> torch.Tensor:
    """Vectors of norm exactly c whose rounding is as spread as it gets: every coordinate's fraction
    ½ (flat), one spike, a spike with ½ fractions elsewhere, random directions, and negatives."""
    flat = torch.full((D,), c / math.sqrt(D), dtype=torch.float64)
    half = torch.floor(flat) + 0.5
    half = half * (c / float(torch.linalg.vector_norm(half)))
    spike = torch.zeros(D, dtype=torch.float64)
    spike[0] = c
    mixed = torch.full((D,), 0.5, dtype=torch.float64)
    mixed[0] = math.sqrt(max(c**2 - 0.25 * (D - 1), 0.0))
    g = torch.Generator().manual_seed(3)
    rand = torch.randn(20, D, generator=g, dtype=torch.float64)
    rand = rand / torch.linalg.vector_norm(rand, dim=1, keepdim=True) * c
    rows = torch.cat([torch.stack([flat, half, spike, mixed, -flat, -half]), rand])
    return rows / torch.linalg.vector_norm(rows, dim=1, keepdim=True).clamp_min(1e-300) * c


@pytest.mark.parametrize(("c", "D"), [(0.3, 16), (3.0, 64), (40.0, 256), (7.5, 1024)])
def test_conditional_rounding_never_exceeds_its_bound_at_the_bound(c, D):
    x = adversarial_at_the_bound(c, D).repeat(40, 1)
    bound = dist.rounded_bound(c, D)
    g = torch.Generator().manual_seed(0)
    r = dist.conditional_round(x, bound, g)
    assert r.dtype == torch.int64
    assert int((r * r).sum(dim=1).max()) <= bound**2
    # unbiased enough to be a rounding: every coordinate is the floor or the ceiling of its input
    assert bool(((r - torch.floor(x)) >= 0).all() and ((r - torch.ceil(x)) <= 0).all())


def test_conditional_rounding_falls_back_toward_zero_within_the_bound():
    x = torch.full((3, 64), 0.5, dtype=torch.float64)  # norm 4; any rounding up of many coords exceeds 4
    r = dist.conditional_round(x, 4.0, torch.Generator().manual_seed(0))
    assert int((r * r).sum(dim=1).max()) <= 16


def test_encoding_reclips_a_unit_over_its_bound():
    enc = dist.StatEncoding("b", (16,), False, 1.0, 10.0, dist.rounded_bound(10.0, 16), 0.0, 16, 5)
    x = torch.randn(50, 16, dtype=torch.float64) * 1e6  # far over the declared bound B = 1
    g = torch.Generator().manual_seed(1)
    for row in x:
        r = dist.encode_units(row.unsqueeze(0), enc, g)
        assert float(torch.linalg.vector_norm(r.double())) <= enc.rounded_bound


def test_psd_units_move_the_rounded_sum_by_at_most_the_tightened_bound():
    """Two PSD units at full norm with orthogonal triangles (the √2 pair) and a PSD unit against zero:
    over many roundings the integer move stays ≤ √2·sB + 2√D, and the pair reaches most of it."""
    n, bound = 6, 1.0
    enc = dist.StatEncoding("A", (n, n), True, bound, 30.0, dist.rounded_bound(30.0, 32), 0.0, 16, 9, psd=True)
    e1, e2 = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    e1[0], e2[1] = 1.0, 1.0
    g = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    dense = g @ g.T
    pairs = [
        (torch.outer(e1, e1), torch.outer(e2, e2)),
        (dense / torch.linalg.matrix_norm(dense), torch.zeros(n, n, dtype=torch.float64)),
        (torch.outer(e1 + e2, e1 + e2) / 2, torch.outer(e1 - e2, e1 - e2) / 2),
    ]
    largest = 0.0
    for a, b in pairs:
        x, y = (dist.flatten(m.unsqueeze(0), (n, n), True) for m in (a, b))
        for t in range(200):
            ka, kb = torch.tensor([2 * t]), torch.tensor([2 * t + 1])  # each row's own key
            move = (dist.encode_units(x, enc, ka) - dist.encode_units(y, enc, kb)).double()
            assert float(torch.linalg.vector_norm(move)) <= enc.l2_sensitivity
            assert float(move.abs().sum()) <= enc.l1_sensitivity
            largest = max(largest, float(torch.linalg.vector_norm(move)) / enc.l2_sensitivity)
    assert enc.l2_sensitivity < 2 * enc.rounded_bound and largest > 0.7


# ----- modular sum and noise ----------------------------------------------------------------------
def test_modular_sum_equals_the_integer_sum_without_a_wrap_and_wraps_are_seen():
    g = torch.Generator().manual_seed(0)
    vectors = torch.randint(-1000, 1000, (7, 50), generator=g)
    exact = vectors.sum(0)
    for bits in (14, 20):
        modular = dist.modular(dist.modular(vectors, bits).sum(0), bits)
        assert torch.equal(dist.centered(modular, bits), exact)
    modular = dist.modular(dist.modular(vectors, 10).sum(0), 10)  # range ±512: the sum wraps
    assert int((dist.centered(modular, 10) != exact).sum()) > 0


def test_no_suspected_wrap_on_honest_worst_case_sums():
    """An honest sum at its largest (all n units at the bound in one direction, independent of the
    rotation seed; every node's noise share, sized for fewer survivors) never reaches τ over 200 draws, while
    reaching over a third of it (so τ is not far above what honest sums do); of a planted shift by 2^(b−1),
    exactly the coordinates it moved beyond τ are flagged."""
    shape = dist.StatShape("w", (9,), 1.0, False)
    units, nodes, min_nodes, bits = 50, 5, 3, 12
    (enc,) = dist._encodings([shape], units, 2.0, nodes, min_nodes, bits, seed=7)
    tau = dist.suspect_threshold(enc)
    g = torch.Generator().manual_seed(1)
    largest = 0.0
    for _ in range(200):
        direction = torch.randn(9, generator=g, dtype=torch.float64)
        x = (direction / torch.linalg.vector_norm(direction)).expand(units, 9)
        total = dist.encode_units(x, enc, g) + sum(dist.noise_share(enc, min_nodes, g) for _ in range(nodes))
        modular = dist.modular(total, bits)
        assert dist.suspected_wraps(modular, enc) == 0
        largest = max(largest, float(dist.centered(modular, bits).abs().max()) / tau)
    assert 0.33 < largest < 1
    # every coordinate shifted by half the range: a coordinate v lands at 2^(b−1) − |v| from 0, beyond τ
    # exactly when the shift took it more than τ away (the wraps a server can see)
    planted = dist.modular(total + 2 ** (bits - 1), bits)
    seen = int((2 ** (bits - 1) - dist.centered(dist.modular(total, bits), bits).abs() > tau).sum())
    assert dist.suspected_wraps(planted, enc) == seen > enc.padded // 2


def test_skellam_shares_sum_to_the_declared_variance():
    g = torch.Generator().manual_seed(0)
    shares = torch.stack([dist.skellam_noise((20000,), 30.0 / 6, g) for _ in range(6)]).sum(0).double()
    assert abs(float(shares.mean())) < 0.15
    assert abs(float(shares.var()) / 30.0 - 1) < 0.04
    # an integer distribution, equal to scipy's Skellam PMF (chi-square over the central cells)
    ks, counts = torch.unique(shares.long(), return_counts=True)
    keep = counts >= 50
    expected = stats.skellam(15.0, 15.0).pmf(ks[keep].numpy()) * shares.numel()
    chi2 = float((((counts[keep].numpy() - expected) ** 2) / expected).sum())
    assert chi2 < stats.chi2.ppf(0.999, int(keep.sum()) - 1)


# ----- accounting ---------------------------------------------------------------------------------
def exact_epsilon(variance: float, shift: int, delta: float, count: int = 1) -> float:
    """ε(δ) of ``count`` releases of the 1-D pair Sk(V) vs shift + Sk(V): the privacy loss of the two
    explicit PMFs (composed by convolving the losses' distribution), both directions."""
    half = variance / 2
    width = int(12 * math.sqrt(variance) + 12 * shift + 50)
    k = np.arange(-width, width + 1)
    p = stats.skellam.pmf(k, half, half)
    q = stats.skellam.pmf(k - shift, half, half)
    best = 0.0
    for a, b in ((p, q), (q, p)):
        ok = (a > 0) & (b > 0)
        loss = np.log(a[ok]) - np.log(b[ok])
        lost = float(a[~ok].sum())  # mass where the other PMF is 0: loss ∞ (none at these widths)
        grid = 1e-4
        idx = np.round(loss / grid).astype(np.int64)
        lo = idx.min()
        pmf = np.bincount(idx - lo, weights=a[ok])
        total_lo = lo
        dist_pmf = pmf
        for _ in range(count - 1):
            dist_pmf = np.clip(signal.fftconvolve(dist_pmf, pmf), 0.0, None)
            total_lo += lo
        losses = (np.arange(dist_pmf.size) + total_lo) * grid

        def delta_of(eps: float, losses: np.ndarray = losses, w: np.ndarray = dist_pmf, lost: float = lost) -> float:
            m = losses > eps
            return float((w[m] * (1 - np.exp(eps - losses[m]))).sum()) + lost

        lo_e, hi_e = 0.0, float(losses.max()) + 1
        if delta_of(0.0) <= delta:
            continue
        for _ in range(100):
            mid = (lo_e + hi_e) / 2
            lo_e, hi_e = (mid, hi_e) if delta_of(mid) > delta else (lo_e, mid)
        best = max(best, hi_e)
    return best


CROSS_CHECK = [(1.0, 1, 1), (4.0, 1, 1), (25.0, 2, 1), (100.0, 3, 1), (400.0, 5, 1), (2500.0, 10, 1), (100.0, 3, 3)]


@pytest.mark.parametrize(("variance", "shift", "count"), CROSS_CHECK)
def test_skellam_rdp_never_understates_the_exact_privacy_loss(variance, shift, count):
    delta = 1e-5
    exact = exact_epsilon(variance, shift, delta, count)
    event = SkellamDpEvent(variance, float(shift), float(shift))
    reported = skellam.rdp_epsilon(
        event if count == 1 else __import__("dp_accounting").SelfComposedDpEvent(event, count), delta
    )
    assert reported >= exact * (1 - 1e-3) - 1e-3
    assert reported <= 3 * exact + 1.0  # and it is not vacuous


def test_skellam_rdp_tends_to_the_gaussian_and_composes_additively():
    orders = list(skellam.ORDERS)
    ev = SkellamDpEvent(1e8, 2e3, 2e3 * 10)  # z = 2σ/Δ₂ = 10
    gauss = skellam.event_rdp(__import__("dp_accounting").GaussianDpEvent(10.0), orders)
    np.testing.assert_allclose(skellam.event_rdp(ev, orders), gauss, rtol=1e-4)
    both = __import__("dp_accounting").ComposedDpEvent([ev, ev])
    np.testing.assert_allclose(skellam.event_rdp(both, orders), 2 * skellam.event_rdp(ev, orders))


def test_ledger_of_skellam_releases_is_accounted_and_round_trips():
    from fedpers.privacy.ledger import Release

    ev = SkellamDpEvent(1e4, 20.0, 80.0)
    ledger = Ledger([Release(0, "x", "skellam_distributed", 1.0, 2.0, 1.0, "all", ev, {})])
    again = Ledger.from_json(ledger.to_json())
    assert again == ledger
    eps = ledger_epsilon(again, 1e-5)
    assert eps == pytest.approx(skellam.rdp_epsilon(ev, 1e-5))
    assert math.isclose(again.releases[0].noise_multiplier, 2 * 100 / 20)


# ----- whole runs ---------------------------------------------------------------------------------
SMALL = dict(n_users=160, dim=5, rank=2, samples_per_user=16, rounds=2, baselines="none")


def resolved(epsilon: float, **options: object) -> Any:
    cfg = config.build(AltMinConfig, {**SMALL, "epsilon": epsilon})
    return resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, {"nodes": 4, **options}))


def ran(epsilon: float, **options: object) -> tuple[Any, Any, list[Any]]:
    p = resolved(epsilon, **options)
    state, records = run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    return p, state, records


@pytest.fixture(scope="module")
def distributed_run() -> tuple[Any, Any, list[Any]]:
    return ran(2.0, dp_model="distributed", bits=12)


def test_distributed_altmin_ledger_is_skellam_within_target_and_no_wrap(distributed_run):
    p, _, records = distributed_run
    eps = ledger_epsilon(p.privatizer.ledger, 1e-5)
    assert 0.97 * 2.0 <= eps <= 2.0
    assert p.privatizer.plan.bits == 12
    assert all(r.diagnostics["modular_wraps"] == 0 and r.diagnostics["nodes_survived"] == 4 for r in records)


def test_distributed_release_records_its_integer_sensitivities(distributed_run):
    p, _, _ = distributed_run
    releases = p.privatizer.ledger.releases
    assert releases and [r.mechanism for r in releases] == ["skellam_distributed"] * len(releases)
    for r in releases:
        enc = p.privatizer.plan.encodings[r.params["statistic"]]
        assert isinstance(r.event, SkellamDpEvent)
        c = dist.rounded_bound(enc.scale * enc.bound, enc.padded)
        l2 = 2 * c
        if r.params["statistic"] == "A":  # PSD units: the √2 bound survives rounding, + 2√D
            assert r.params["psd_tightened"]
            l2 = min(2 * c, math.sqrt(2) * (1 + 1e-9) * enc.scale * enc.bound + 2 * math.sqrt(enc.padded))
        assert r.event.l2_sensitivity == pytest.approx(l2)
        l1 = min(2 * c * min(math.sqrt(enc.padded), c), l2 * min(math.sqrt(enc.padded), l2))
        assert r.event.l1_sensitivity == pytest.approx(l1)
        assert r.event.variance == pytest.approx((p.privatizer.plan.noise_multiplier * l2 / 2) ** 2)
        assert r.params["bits"] == 12


def test_distributed_at_32_bits_without_noise_equals_central_to_the_rounding():
    _, central, _ = ran(math.inf)
    _, distributed, _ = ran(math.inf, dp_model="distributed", bits=32)
    Uc, Ud = central["U"], distributed["U"]
    assert float(torch.linalg.matrix_norm(Uc @ Uc.T - Ud @ Ud.T)) < 1e-4
    assert float(torch.linalg.matrix_norm(Uc @ Uc.T - Ud @ Ud.T)) > 0  # it did round


def test_distributed_at_32_bits_calibrates_the_central_noise():
    # against central accounted in RDP too: the Skellam bound is an RDP bound, so RDP is the like-for-like
    cfg = config.build(AltMinConfig, {**SMALL, "epsilon": 2.0, "accountant": "rdp"})
    central = resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, {"nodes": 4}))
    opts = config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "bits": 32})
    p = resolve(AltMinExperiment(), cfg, opts)
    ratio = p.privatizer.plan.noise_multiplier / central.protocol.noise_multiplier
    assert 0.99 <= ratio < 1.01  # integers cost < 1 % of noise at 32 bits (its own integer RDP orders: ±1 %)


def test_local_dp_records_a_local_release_per_statistic_and_noises_each_unit():
    p, _, _ = ran(2.0, dp_model="local")
    assert 0.97 * 2.0 <= ledger_epsilon(p.privatizer.ledger, 1e-5) <= 2.0
    first = p.privatizer.ledger.releases[0]
    assert first.mechanism == "local_gaussian" and first.params["units_released"] == SMALL["n_users"]
    assert first.noise_std == pytest.approx(p.privatizer.plan.noise_multiplier * first.per_unit_bound)
    # the nodes' noise: each of U units adds N(0, (zB)²), so the sum of zeros has variance U·(zB)²
    std = first.noise_std
    g = torch.Generator().manual_seed(0)
    sums = torch.stack(
        [dist.local_gaussian(torch.zeros(25, 30, dtype=torch.float64), std, g, False) for _ in range(200)]
    )
    assert float(sums.var()) / (25 * std**2) == pytest.approx(1.0, rel=0.05)


def test_fedrep_runs_distributed():
    base = dict(n_users=120, dim=5, rank=2, samples_per_user=8, rounds=2, epsilon=4.0)
    cfg = config.build(FedRepConfig, base)
    p = resolve(FedRepExperiment(), cfg, config.build(RuntimeOptions, {"nodes": 3, "dp_model": "distributed"}))
    run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    assert {r.mechanism for r in p.privatizer.ledger} == {"skellam_distributed"}
    assert 0.97 * 4.0 <= ledger_epsilon(p.privatizer.ledger, cfg.delta) <= 4.0


def test_node_side_models_refuse_what_they_cannot_privatise_before_any_release():
    cfg = config.build(AltMinConfig, {**SMALL, "epsilon": math.inf, "cohorts": "poisson", "sampling_rate": 0.5})
    with pytest.raises(ValueError, match="Poisson"):  # distributed runs it (tests/test_skellam_sampled.py)
        resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, {"dp_model": "local"}))
    with pytest.raises(ValueError, match="min_nodes"):
        config.build(RuntimeOptions, {"nodes": 3, "min_nodes": 4})
    with pytest.raises(ValueError, match="bits"):
        config.build(RuntimeOptions, {"bits": 2})
    with pytest.raises(ValueError, match="bits"):
        config.build(RuntimeOptions, {"bits": 40})
    assert config.build(RuntimeOptions, {}).dp_model is DpModel.CENTRAL


def test_too_few_surviving_nodes_discard_the_round_before_any_release():
    p = resolved(2.0, dp_model="distributed", min_nodes=3)
    with pytest.raises(RoundFailed, match="min_nodes=3"):
        run_local_nodes(
            p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False, survive=lambda r, n: n < 2
        )
    assert len(p.privatizer.ledger) == 0
    # three survivors of four: the round goes on, its noise what three shares make (V, the recorded minimum)
    p = resolved(2.0, dp_model="distributed", min_nodes=3)
    source = p.experiment.unit_source(p.cfg)
    run_local_nodes(p.protocol, source, p.privatizer, progress=False, survive=lambda r, n: n != 1)
    first = p.privatizer.ledger.releases[0]
    assert first.params["nodes_survived"] == 3
    assert first.event.variance == pytest.approx(p.privatizer.plan.encodings["W"].variance)


# ----- worst-case neighbours through the distributed path -------------------------------------------
def test_worst_case_neighbours_move_the_integer_sum_within_the_recorded_sensitivity():
    """One unit replaced by adversarial data (huge, overflowing, zero, U-aligned, alternating): through
    the nodes' encoding and the modular sum, the server's integer sum moves by ≤ the Δ₂ and Δ₁ the ledger
    records for that release (each unit rounds with its own generator and the nodes' noise shares are
    the same, so the move is that unit's alone)."""
    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round
    from tests.neighbours import adversaries, replace_unit

    cfg = config.build(AltMinConfig, dict(n_users=24, dim=4, rank=2, samples_per_user=8, rounds=2, epsilon=2.0))
    opts = config.build(RuntimeOptions, {"nodes": 3, "dp_model": "distributed", "bits": 16})
    p = resolve(AltMinExperiment(), cfg, opts)
    units = {k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(24)).items()}
    U = torch.linalg.qr(torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    cohort = int(p.protocol.cohort_of(torch.tensor([5]))[0])
    largest = 0.0
    for round, broadcast in ((0, {}), (cohort, {"U": U})):
        reference = node_round(p.protocol, round, broadcast, UnitSource.of(units), p.privatizer)
        for label, new in adversaries(units["x"][5], units["y"][5], torch.float64, U[:, 0]).items():
            moved = node_round(p.protocol, round, broadcast, UnitSource.of(replace_unit(units, 5, new)), p.privatizer)
            for name, before in reference.modular.items():
                enc = p.privatizer.plan.encodings[name]
                diff = dist.centered(moved.modular[name] - before, enc.bits).double()
                l2, l1 = float(torch.linalg.vector_norm(diff)), float(diff.abs().sum())
                assert l2 <= enc.l2_sensitivity and l1 <= enc.l1_sensitivity, (label, name, l2, enc.l2_sensitivity)
                largest = max(largest, l2 / enc.l2_sensitivity)
    assert largest > 0.4  # the adversaries did push a release a good part of its integer sensitivity


def test_declared_dropout_rate_is_charged_by_the_survivors_noise():
    from fedpers.runtime.distributed import dropouts

    # 8 nodes (SecAgg+ threshold 4 of each 7-node neighbourhood): every round of these draws can be unmasked
    p = resolved(2.0, dp_model="distributed", min_nodes=1, node_dropout=0.3, nodes=8)
    run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    survive = dropouts(0.3, p.privatizer.dropout_seed)
    V = p.privatizer.plan.encodings
    seen = set()
    for r in p.privatizer.ledger:
        k = sum(survive(r.round, node) for node in range(8))
        assert r.params["nodes_survived"] == k >= 1
        assert r.event.variance == pytest.approx(V[r.params["statistic"]].variance * k)  # k shares of V/1
        seen.add(k)
    assert len(seen) > 1 or seen != {8}  # the rate did drop someone
    assert ledger_epsilon(p.privatizer.ledger, 1e-5) <= 2.0
    with pytest.raises(ValueError, match="node_dropout"):
        config.build(RuntimeOptions, {"node_dropout": 0.1})


def test_noise_that_reaches_the_sum_is_the_recorded_variance():
    """End to end through the nodes: two runs of one round on the same data with different noise seeds
    differ by two independent draws of the summed shares, so (Δ sum)/√(2V) has variance 1 for the V the
    ledger records (min_nodes 2 of 4 nodes: each share is V/2, four of them reach the sum, 2V in total)."""
    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round

    p = resolved(2.0, dp_model="distributed", bits=16, min_nodes=2)
    source = UnitSource.of({k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(160)).items()})
    U = torch.linalg.qr(torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    z = []
    for seed in range(6):
        sums = []
        for offset in (0, 1000):
            p.privatizer.noise_seed = seed + offset
            sums.append(node_round(p.protocol, 1, {"U": U}, source, p.privatizer).modular)
        for name, enc in p.privatizer.plan.encodings.items():
            if name in sums[0]:
                total_variance = enc.event(4, 2).variance  # what a release with 4 survivors records
                diff = dist.centered(sums[0][name] - sums[1][name], enc.bits).double()
                z.append(diff / math.sqrt(2 * total_variance))
    ratio = float(torch.cat(z).var())
    assert 0.75 < ratio < 1.3, ratio


def test_collusion_sizes_the_shares_so_the_honest_survivors_carry_the_recorded_noise():
    """--collusion c: a server that colludes with c nodes knows their shares and subtracts them, so each
    share is Sk(V/(m − c)) and a release records the other survivors' shares only: m − c honest survivors
    carry exactly V. Without it the same m − c shares carry (m − c)/m of V, which is what the option fixes."""
    p = resolved(2.0, dp_model="distributed", bits=16, min_nodes=3, collusion=2)
    plan = p.privatizer.plan
    assert (plan.min_nodes, plan.collusion, plan.honest) == (3, 2, 1)
    for enc in plan.encodings.values():
        assert enc.event(3, 3, 2).variance == pytest.approx(enc.variance)  # m − c honest survivors: V
        assert enc.event(4, 3, 2).variance == pytest.approx(2 * enc.variance)
    g = torch.Generator().manual_seed(0)
    plain = resolved(2.0, dp_model="distributed", bits=16, min_nodes=3).privatizer.plan
    for sized, expected in ((plan, 1.0), (plain, 1 / 3)):
        enc = sized.encodings["b"]
        one_honest = torch.cat([dist.noise_share(enc, sized.honest, g) for _ in range(400)]).double()
        assert abs(float(one_honest.var()) / (expected * enc.variance) - 1) < 0.05
    p, _, _ = ran(2.0, dp_model="distributed", bits=16, min_nodes=3, collusion=2)
    assert ledger_epsilon(p.privatizer.ledger, 1e-5) <= 2.0
    assert all(r.params["collusion"] == 2 and r.params["nodes_survived"] == 4 for r in p.privatizer.ledger)
    with pytest.raises(ValueError, match="collusion must be in"):
        config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "min_nodes": 2, "collusion": 2})
    with pytest.raises(ValueError, match="collusion needs --dp-model distributed"):
        config.build(RuntimeOptions, {"nodes": 4, "dp_model": "local", "collusion": 1})


def test_local_dp_noises_every_unit_fully_however_many_units_a_node_holds():
    """Local DP's guarantee is per unit: each of a node's u units carries its own N(0, (zB)²), so a node's
    vector (what the server sees) holds u·(zB)² of noise and each unit's is the ledger's. Measured through
    the nodes (two noise seeds, same data: the difference is two draws of the node's noise) at 10 units
    per node (one per node: the audit's tests); a noise scale divided by √u (a node-level mechanism passed
    off as per-unit: multiplier z/√u) fails at 10 by a factor 10."""
    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round

    users_per_node = 10
    cfg = config.build(AltMinConfig, {**SMALL, "n_users": 40, "epsilon": 2.0, "cohorts": "all"})
    nodes = 40 // users_per_node
    opts = {"nodes": nodes, "dp_model": "local", "users_per_node": users_per_node}
    p = resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, opts))
    source = UnitSource.of({k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(40)).items()})
    U = torch.linalg.qr(torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    z = []
    for seed in range(10):
        seen: list[dict[str, torch.Tensor]] = [{}, {}]
        for i, offset in enumerate((0, 1000)):
            p.privatizer.noise_seed = seed + offset

            def keep(round: int, name: str, vectors: torch.Tensor, survivors: Any, i: int = i) -> None:
                seen[i][name] = vectors

            node_round(p.protocol, 1, {"U": U}, source, p.privatizer, observe=keep)
        for name, vectors in seen[0].items():
            assert vectors.shape[0] == nodes  # one vector per node, in the clear
            std = p.privatizer.plan.noise_multiplier * p.privatizer.plan.encodings[name].bound
            z.append(((vectors - seen[1][name]) / math.sqrt(2 * users_per_node * std**2)).flatten())
    ratio = float(torch.cat(z).var())
    assert 0.8 < ratio < 1.25, ratio  # ≥ 2,600 draws: 7σ either side; a √u-scaled noise gives 0.1
