"""AltMin's protocol calibrated to the run's (ε, δ), and the paper's own calibration rule."""

from __future__ import annotations

import math

from fedpers.configs.altmin import AltMinConfig
from fedpers.experiments.altmin.plan import resolve_plan
from fedpers.privacy import Calibrations
from fedpers.protocols.altmin import AltMinProtocol


def make_protocol(
    cfg: AltMinConfig, *, private: bool = True, calibrations: Calibrations | None = None
) -> AltMinProtocol:
    """:meth:`AltMinPlan.protocol` of ``cfg``."""
    return resolve_plan(cfg).protocol(private=private, calibrations=calibrations)


def paper_epsilon(noise_to_sensitivity: float, rounds_in: int, delta: float) -> float:
    """ε that Theorem 4.2 of the personalization paper claims for this noise.

    With every release's noise σ = r·Δ (Δ its replace-one sensitivity), the paper's proof
    (Lemmas 4.3, 4.5) gives RDP α/(2r²) per Gaussian, so α/r² for a round's (A, b) and for
    the initialisation, and Theorem 4.2 sets r = sqrt(16 log(1/δ))/ε for the init plus one
    round: ε = sqrt(16 log(1/δ))/r. A user in ``rounds_in`` rounds (every round with
    ``--cohorts all``) composes 1 + rounds_in such steps: ε = sqrt(8 (1 + rounds_in) log(1/δ))/r.
    """
    if noise_to_sensitivity == 0:
        return math.inf
    return math.sqrt(8 * (1 + rounds_in) * math.log(1 / delta)) / noise_to_sensitivity
