"""Worst-case neighbours through the real server path.

A :class:`TapPrivatizer` is the real :class:`~fedpers.privacy.Privatizer` that also keeps the
exact pre-noise value of every release. Replaying a reference run's noisy outputs into a
run on the neighbouring data keeps every broadcast identical, so each release is compared
on the same public state — the adaptive-composition notion of sensitivity — while the
neighbour's statistics still go through ``client_message`` → ``drive`` → ``server_update``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fedpers.privacy import Privatizer
from fedpers.privacy.ledger import Release
from fedpers.protocols.base import Protocol
from fedpers.runtime.local import run_local

Tensor = torch.Tensor


class TapPrivatizer(Privatizer):
    """Records (release, pre-noise value) per release; with ``replay`` returns those outputs
    instead of drawing (a ``None`` entry, or a release past the list's end, draws afresh)."""

    def __init__(self, seed: int, replay: list[Any] | None = None, neighbours: str = "replace-one") -> None:
        super().__init__(seed, neighbours=neighbours)
        self.values: list[tuple[Release, Any]] = []
        self.outputs: list[Any] = []
        self.replay = replay

    def _tap(self, release: Release, value: Any, produce: Callable[[], Any]) -> Any:
        self.values.append((release, value.detach().clone() if isinstance(value, Tensor) else value))
        i = len(self.outputs)
        out = (
            self.replay[i]
            if self.replay is not None and i < len(self.replay) and self.replay[i] is not None
            else produce()
        )
        self.outputs.append(out)
        return out

    def _perturb(self, release, value, noise):
        return self._tap(release, value, lambda: Privatizer._perturb(self, release, value, noise))

    def _select(self, release, scores, sample):
        return self._tap(release, scores, lambda: Privatizer._select(self, release, scores, sample))

    def _sample_covariance(self, release, A, draw):
        return self._tap(release, A, lambda: Privatizer._sample_covariance(self, release, A, draw))


def run(protocol: Protocol, units: dict[str, Tensor], privatizer: Privatizer, chunk_size: int = 7) -> tuple[Any, list]:
    """The local runtime (small chunks, so a bad unit shares its chunk with honest ones)."""
    return run_local(protocol, units, privatizer, chunk_size=chunk_size, progress=False)


def change(release: Release, before: Tensor, after: Tensor) -> float:
    """How far a release's pre-noise value moved, in the norm its sensitivity is stated in."""
    diff = after.double() - before.double()
    if release.mechanism == "exponential":
        return float(diff.abs().max())
    return float(torch.linalg.vector_norm(diff))


def replace_unit(units: dict[str, Tensor], j: int, new: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {k: v.clone() for k, v in units.items()}
    for k, v in new.items():
        out[k][j] = v.to(out[k].dtype)
    return out


@dataclass
class NeighbourOutcome:
    releases: int
    changes: list[tuple[Release, float]]
    zeroed: int


def check_neighbour(
    protocol: Protocol,
    units: dict[str, Tensor],
    j: int,
    new: dict[str, Tensor],
    groups: set[str],
    seed: int = 3,
    rel_tol: float = 1e-9,
    neighbours: str = "replace-one",
) -> NeighbourOutcome:
    """Assert (a) every release moves by ≤ the sensitivity its ledger entry records, (b) only
    releases of ``groups`` (the unit's cohort and ``all``) move, (c) the run completes on the
    neighbour with the same number of releases. Returns what moved, for reach tests. Under
    ``neighbours`` add-remove, ``new`` is the unit's data that contributes nothing (its absence)."""
    reference = TapPrivatizer(seed, neighbours=neighbours)
    run(protocol, units, reference)
    neighbour = replace_unit(units, j, new)
    replayed = TapPrivatizer(seed, replay=reference.outputs, neighbours=neighbours)
    _, records = run(protocol, neighbour, replayed)
    fresh = TapPrivatizer(seed, neighbours=neighbours)
    run(protocol, neighbour, fresh)  # (c): the neighbour's own run, its own noise
    assert len(fresh.ledger) == len(reference.ledger) == len(replayed.ledger)
    changes = []
    for (release, before), (again, after) in zip(reference.values, replayed.values):
        assert (again.name, again.sensitivity, again.units) == (release.name, release.sensitivity, release.units)
        moved = change(release, before, after)
        scale = max(1.0, float(before.double().abs().max()))
        slack = rel_tol * max(release.sensitivity, scale)
        assert moved <= release.sensitivity + slack, (release.name, moved, release.sensitivity)  # (a)
        if moved > slack:
            assert release.units in groups, (release.name, release.units, groups)  # (b)
        changes.append((release, moved))
    return NeighbourOutcome(len(reference.ledger), changes, sum(r.zeroed for r in records))


def adversaries(
    x: Tensor, y: Tensor | None, dtype: torch.dtype, aligned: Tensor | None = None
) -> dict[str, dict[str, Tensor]]:
    """Adversarial replacements for one unit with data (x, y): huge, overflowing, zero, aligned, alternating."""
    huge = 1e30 if dtype == torch.float32 else 1e160
    over = 1e39 if dtype == torch.float32 else 1e300  # 1e39 is not finite in float32
    out: dict[str, dict[str, Tensor]] = {
        "huge x": {"x": x * huge},
        "zero x": {"x": torch.zeros_like(x)},
        "overflowing x": {"x": x.double() * over},
        "huge x and y": {"x": x * huge},
        "large x and y": {"x": x * 1e3},
    }
    if y is not None and y.is_floating_point():
        sign = torch.ones_like(y).flatten()
        sign[1::2] = -1
        out["huge y"] = {"y": y * huge}
        out["overflowing y"] = {"y": y.double() * over}
        out["huge x and y"]["y"] = y * huge
        out["large x and y"]["y"] = y * 1e3  # large enough for every clip, small enough not to overflow
        out["alternating y"] = {"y": huge * sign.reshape(y.shape)}
        out["zero x, huge y"] = {"x": torch.zeros_like(x), "y": y * huge}
    if aligned is not None:
        out["x aligned with U"] = {"x": (aligned * huge).expand_as(x).clone()}
    return out
