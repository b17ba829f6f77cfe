"""fedpers' ε against an independent accountant (Microsoft's prv-accountant), to 1e-3 relative.

Neighbouring relations differ: fedpers' events are replace-one, and a replace-one Gaussian
with noise multiplier z is the add/remove Gaussian with z/2 (the sensitivity doubles); the
pure-ε part is the same under both.
"""

from __future__ import annotations

import dp_accounting
import pytest

from fedpers import config
from fedpers.experiments.altmin import AltMinConfig, make_protocol
from fedpers.privacy import PureDpEvent, event_epsilon
from fedpers.protocols.altmin import AltMinProtocol

prv = pytest.importorskip("prv_accountant")


def prv_epsilon(gaussians: dict[float, int], delta: float, pure: float | None = None) -> float:
    """prv-accountant's ε for self-composed replace-one Gaussians {z: count} (and a pure-ε part)."""
    mechanisms = [prv.GaussianMechanism(noise_multiplier=z / 2) for z in gaussians]
    counts = list(gaussians.values())
    if pure is not None:
        mechanisms.append(prv.PureDPMechanism(eps=pure))
        counts.append(1)
    acc = prv.PRVAccountant(prvs=mechanisms, max_self_compositions=counts, eps_error=1e-4, delta_error=1e-10)
    return acc.compute_epsilon(delta=delta, num_self_compositions=counts)[1]


def gaussians(z: float, count: int) -> dp_accounting.DpEvent:
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z)] * count)


def test_single_replace_one_gaussian():
    assert event_epsilon(gaussians(1.0, 1), 1e-5) == pytest.approx(prv_epsilon({1.0: 1}, 1e-5), rel=1e-3)


def test_the_default_altmin_run():
    protocol = make_protocol(config.build(AltMinConfig, {}))
    releases = protocol.releases_per_user()
    ours = event_epsilon(AltMinProtocol.user_event(protocol.noise_multiplier, releases), 1e-5)
    theirs = prv_epsilon({protocol.noise_multiplier: releases}, 1e-5)
    assert ours == pytest.approx(theirs, rel=1e-3) and theirs == pytest.approx(4.0, rel=1e-3)


@pytest.mark.slow
def test_a_fifty_step_composition_like_noisyhead():
    assert event_epsilon(gaussians(30.0, 50), 1e-5) == pytest.approx(prv_epsilon({30.0: 50}, 1e-5), rel=1e-3)


def test_gaussians_with_a_pure_epsilon_mechanism():
    event = dp_accounting.ComposedDpEvent([gaussians(4.0, 3), PureDpEvent(0.5)])
    assert event_epsilon(event, 1e-6) == pytest.approx(prv_epsilon({4.0: 3}, 1e-6, pure=0.5), rel=1e-3)
