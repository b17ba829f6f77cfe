"""What an algorithm may offer beyond a run: its audit canaries and its private tuning scores.

An :class:`~fedpers.experiments.base.Experiment` returns these from its optional hooks
(``canary_design``, ``private_scores``); ``fedpers audit`` and ``fedpers sweep --select
--private`` ask the experiment for them, so an algorithm's knowledge stays in its own module.
The types live here, beneath the commands and sweeps that consume them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import Protocol as Interface

import torch

from fedpers.privacy import Calibrations
from fedpers.protocols.base import Protocol

Tensor = torch.Tensor

BIG = 1e6
"""How far past a clip a canary's value lies (the clip binds for any model not ~0)."""
LABEL_OVERSHOOT = 1.5
"""A canary's labels are this many times the label clip ζ: the clip binds, and were it missing,
the canaries' sum would still pass the server's norm check (√K·1.5²·bound ≤ K·bound for K ≥ 6)
so the missing clip shows in the audit instead of aborting the run."""


def as_sent(name: str, stat: Tensor) -> Tensor:
    """A client's statistic released as it is sent (the default of :attr:`Canaries.as_released`)."""
    return stat


@dataclass(frozen=True)
class Canaries:
    """K canary users: unit tensors of both versions (leading dimension K) and how they were built.

    ``as_released(name, stat)`` maps a client's statistic ``name`` to the form the server
    releases it in (e.g. the block upper triangles of a symmetric statistic), so the scorer
    compares a canary's contribution with the release coordinate by coordinate."""

    plus: dict[str, Tensor]
    minus: dict[str, Tensor]
    design: str
    as_released: Callable[[str, Tensor], Tensor] = as_sent

    @property
    def count(self) -> int:
        return int(self.plus["ids"].shape[0])

    def units(self, included: Tensor) -> dict[str, Tensor]:
        """The run's population: canary i holds its "+" data where ``included[i]``, else its "−" data."""
        out = {}
        for key, p in self.plus.items():
            mask = included.reshape(-1, *([1] * (p.dim() - 1))).to(p.device)
            out[key] = torch.where(mask, p, self.minus[key]) if key != "ids" else p
        return out

    def one(self, i: int, version: str) -> dict[str, Tensor]:
        src = self.plus if version == "+" else self.minus
        return {k: v[i : i + 1] for k, v in src.items()}


class AuditProtocol(Interface):
    """The configured protocol for a population of ``k`` canaries; ``calibrations`` records the
    noise calibration (a node-side audit solves the nodes' mechanism for the same guarantee)."""

    def __call__(self, cfg: Any, k: int, calibrations: Calibrations | None = None) -> Protocol: ...


@dataclass(frozen=True)
class CanaryDesign:
    """How to audit one algorithm: its protocol for a population of K canaries, the most
    canaries with mutually orthogonal contributions, and the canaries themselves."""

    protocol: AuditProtocol
    capacity: Callable[[Any], int]
    canaries: Callable[[Any, torch.Generator, int], Canaries]
    releases: str
    neighbouring: str
    random_canaries: Callable[[Any, torch.Generator, int], Canaries] | None = None
    """Any number of canaries along random (non-orthogonal) directions, where the design offers
    them; the scorer accounts for their interference."""
    paired_canaries: Callable[[Canaries], Canaries] | None = None
    """The design's own ``paired`` placement from 2K orthogonal canaries (default: each version
    the "+" data of one of two orthogonal canaries)."""
    steer: Callable[[Any, int, Any, Canaries], Canaries] | None = None
    """White-box canaries rebuilt for each round from that round's published broadcast
    (``steer(protocol, round, broadcast, canaries)``), where fixed data cannot reach a release's
    sensitivity: each version's data then depends on what the server published before it."""


@dataclass(frozen=True)
class PrivateScore:
    """A per-user validation statistic, its public clip c, and the held-out users it is computed on.

    ``clip(cfg)``: the public bound c; ``per_user(cfg, protocol, state, units)``: one value per
    held-out user from the released state; ``units(cfg, ids)``: the held-out users' data (ids
    past the training population, which the training never touches)."""

    metric: str
    clip: Callable[[Any], float]
    per_user: Callable[[Any, Any, Any, dict[str, Tensor]], Tensor]
    units: Callable[[Any, Tensor], dict[str, Tensor]]
