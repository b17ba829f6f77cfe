"""Canary placements beyond a design's own: paired (the same data on two orthogonal coordinates) and
steered (rebuilt each round from the broadcast), and which algorithms offer a design at all."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fedpers.audit.scores import Steer, present_only
from fedpers.experiments.hooks import Canaries, CanaryDesign
from fedpers.protocols.base import Protocol

Tensor = torch.Tensor


PLACEMENTS = ("auto", "orthogonal", "random", "paired", "steered")


def paired_canaries(base: Canaries) -> Canaries:
    """Canary i's "+" version is the "+" data of orthogonal canary 2i, its "−" version the "+" data
    of canary 2i + 1: the same user's data on two orthogonal coordinates (blocks) instead of
    opposite signs on one. A release of a sum of PSD per-user matrices (AltMin's A) then moves by
    its full replace-one sensitivity √2·bound, which a sign flip on one coordinate cannot reach (the
    PSD statistic is sign-blind); sign-sensitive releases move by √2 of their 2·bound."""
    k = base.count // 2
    plus = {key: (torch.arange(k) if key == "ids" else v[0 : 2 * k : 2]) for key, v in base.plus.items()}
    minus = {key: (torch.arange(k) if key == "ids" else v[1 : 2 * k : 2]) for key, v in base.plus.items()}
    return Canaries(
        plus,
        minus,
        f'pairs of orthogonal canaries, the same data on either ("+" as in: {base.design})',
        base.as_released,
    )


def audited_algorithms() -> list[str]:
    """The registered algorithms whose experiment offers a canary design (its ``canary_design`` hook)."""
    from fedpers.experiments import ALGORITHMS, experiment

    return [name for name in ALGORITHMS if experiment(name).canary_design() is not None]


def bound_steer(design: CanaryDesign, protocol: Protocol, cans: Canaries) -> Steer:
    steer = design.steer
    assert steer is not None  # checked in audit() before any run

    def at(round: int, broadcast: Mapping[str, Tensor]) -> Canaries:
        return steer(protocol, round, broadcast, cans)

    return at


def steered_units(
    steer: Steer, included: Tensor, present: int
) -> Callable[[int, Mapping[str, Tensor]], Mapping[str, Tensor]]:
    def units(round: int, broadcast: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return present_only(steer(round, broadcast), present).units(included)

    return units
