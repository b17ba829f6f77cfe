"""The √2 PSD tightening under Poisson sampling, pinned against a direct
privacy-loss computation on the worst pair (``tests/worst_pair.py``), independent of dp-accounting.

A PSD unit contribution A_j with ||A_j|| ≤ B is B from absent. The sampled replace-one event
models each unit as Δ/2 from absent; with Δ = √2·B that under-counts by √2, and the pair
A_j ⟂ A'_j at full norm (reached by x̂ ⟂ x̂′ at the clip) spends more than recorded. Sampled PSD
releases are therefore not tightened; unsampled ones keep the (tight) √2 bound.
"""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch

from fedpers.privacy import Privatizer
from fedpers.privacy.accountant import event_epsilon
from tests.worst_pair import epsilon_of

DELTA = 1e-5
H = 0.02  # grid step in σ: ε agrees with h = 0.01 to 1e-6 on these pairs


def release(z: float, q: float, bound: float = 3.0):
    p = Privatizer(0)
    value = torch.diag(torch.tensor([bound, 0.0], dtype=torch.float64))  # a PSD sum (one unit)
    p.symmetric_gaussian_sum(
        value, per_unit_bound=bound, noise_multiplier=z, name="A", round=1, psd_units=True, sampling_probability=q
    )
    return p.ledger.releases[-1]


def pairs(r: float) -> dict[str, tuple]:
    """Neighbouring unit positions at distance r (in σ) from absent, in the plane they span."""
    return {
        "orthogonal (PSD worst: x̂ ⟂ x̂′ at the clip)": ((r, 0.0), (0.0, r)),
        "antipodal (the event's own model)": ((r, 0.0), (-r, 0.0)),
        "60 degrees": ((r, 0.0), (r / 2, r * math.sqrt(3) / 2)),
        "one absent-like (tiny)": ((r, 0.0), (1e-9, 0.0)),
    }


@pytest.mark.parametrize("z, q", [(2.0, 0.1), (1.5, 0.05), (1.0, 0.3), (2.0, 0.6)])
def test_sampled_psd_release_is_sound_on_every_pair(z, q):
    r = release(z, q)
    assert r.sensitivity == pytest.approx(2 * r.per_unit_bound) and r.noise_std == pytest.approx(z * r.per_unit_bound)
    assert "not applied" in r.params["psd_tightening"]
    reported = event_epsilon(r.event, DELTA)
    distance = r.per_unit_bound / r.noise_std  # a PSD unit is its full bound from absent
    for label, (a, a2) in pairs(distance).items():
        true = epsilon_of(DELTA, q, a, a2, h=H)
        assert true <= reported * 1.001 + 1e-4, (label, true, reported)
    # the event's own (antipodal) pair is tight: the accountant is not loose by construction
    assert epsilon_of(DELTA, q, *pairs(distance)["antipodal (the event's own model)"], h=H) == pytest.approx(
        reported, rel=2e-3
    )


@pytest.mark.parametrize("q", [0.5, 0.75, 0.999])
def test_no_sampling_rate_below_one_keeps_the_tightening(q):
    """Every q < 1, however close to 1: a sampled PSD unit is a full bound from absent (Δ = 2·bound)."""
    from fedpers.privacy.mechanisms import psd_sensitivity

    r = release(2.0, q)
    assert r.sensitivity == pytest.approx(2 * r.per_unit_bound) and "not applied" in r.params["psd_tightening"]
    assert psd_sensitivity(3.0, q) == pytest.approx(6.0)


def test_the_old_sampled_tightening_spends_more_than_recorded():
    """What break 3 was: σ = z·B/√2 with the same event; the worst PSD pair spends 1.7× (A alone)."""
    z, q = 2.0, 0.1
    reported = event_epsilon(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), DELTA)
    distance = math.sqrt(2) / z  # B / (z·B/√2)
    true = epsilon_of(DELTA, q, (distance, 0.0), (0.0, distance), h=H)
    assert true > 1.6 * reported


def test_unsampled_psd_tightening_is_sound_and_tight():
    r = release(2.0, 1.0)
    assert r.sensitivity == pytest.approx(math.sqrt(2) * r.per_unit_bound) and "psd_tightening" not in r.params
    reported = event_epsilon(r.event, DELTA)
    distance = r.per_unit_bound / r.noise_std
    true = epsilon_of(DELTA, 1.0, (distance, 0.0), (0.0, distance), h=H)
    assert true == pytest.approx(reported, rel=2e-3)


@pytest.mark.parametrize(
    "value", [torch.diag(torch.tensor([1.0, -1.0])), torch.tensor([[0.0, 1.0], [1.0, 0.0]]), -torch.eye(3)]
)
def test_psd_tightening_refused_for_a_statistic_that_is_not_psd(value):
    p = Privatizer(0)
    with pytest.raises(ValueError, match="not positive semi-definite"):
        p.symmetric_gaussian_sum(value, per_unit_bound=1.0, noise_multiplier=1.0, name="A", round=1, psd_units=True)
    assert len(p.ledger) == 0
    p.symmetric_gaussian_sum(
        value, per_unit_bound=1.0, noise_multiplier=1.0, name="A", round=1
    )  # without the claim: 2·B
    assert p.ledger.releases[-1].sensitivity == 2.0


def test_float32_sums_of_many_psd_contributions_pass_the_check():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 12, generator=g)
    value = torch.einsum("ni,nj->ij", x, x).float() + torch.einsum("ni,nj->ij", x[:, :1], x[:, :1]).float() * 1e4
    p = Privatizer(0)
    p.symmetric_gaussian_sum(value, per_unit_bound=1.0, noise_multiplier=1.0, name="A", round=1, psd_units=True)
    assert len(p.ledger) == 1
