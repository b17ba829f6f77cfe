"""Baselines computed in a private run's own passes over the users (:class:`~fedpers.runtime.local.Companion`).

A baseline that is another run of the same protocol on the same users (clipped-no-noise: the
private run without its noise) needs the same chunks in the same rounds: :class:`ShadowRun` reads
them as the private run reads them instead of generating every user again. Where the two runs'
clients are sent the same broadcast (AltMin's round 0) their messages are the same, so the
shadow sums the private run's message for that chunk rather than computing it twice: its sum is
the private run's sum before noise. Its own server steps use its own privatizer, ledger and
state; nothing of it reaches the private run's releases.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fedpers.experiments.common.lowrank_baselines import NonPrivateAltMin
from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message, Protocol, Units, client_message, zero_message
from fedpers.runtime.local import Companion

Tensor = torch.Tensor


def _same_broadcast(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and bool(torch.equal(a[k], b[k].to(a[k].device)))
        for k in a
    )


class ShadowRun(Companion):
    """``protocol`` run round by round in another local run's passes, on the chunks it reads.

    ``protocol`` must have the run's client side (the same ``client_update`` for the same
    broadcast; only server-side parameters such as the noise may differ) and read the same units
    each round (``units_needed``): then every round's sum equals that of ``run_local(protocol, …)``
    on the same source and chunk size, bit for bit (the chunks are the same and summed in the same
    order). The result is valid only if every round from 0 was seen (:attr:`complete`): a resumed run's
    shadow is not, and its caller computes the baseline on its own.

    ``same_client`` False: ``protocol`` is another protocol whose every round reads units the run
    reads in that round (the run reads every unit in each of its rounds, say) and whose
    ``client_update`` takes part only with its own units of the chunk (a cohort's, say); its sums
    then equal a separate run's to float rounding (chunked otherwise), and the run's message is
    never reused. ``units_map`` turns the run's chunk into this protocol's units (a subset of the
    samples, say). Rounds of the run past ``protocol``'s last are ignored.
    """

    def __init__(
        self,
        protocol: Protocol,
        privatizer: Privatizer,
        *,
        same_client: bool = True,
        units_map: Callable[[Units], Units] | None = None,
    ) -> None:
        self.protocol, self.privatizer = protocol, privatizer
        self.state: Any = protocol.server_start(protocol.initial_state(), privatizer)
        self.next_round = 0
        self.same_client, self.units_map = same_client, units_map
        self._broadcast: dict[str, Tensor] = {}
        self._reuse = False
        self._active = False
        self._total: Message | None = None

    @property
    def complete(self) -> bool:
        return not self.error and self.next_round == self.protocol.num_rounds

    def start_round(self, round: int, broadcast: Mapping[str, Tensor]) -> None:
        self._active = round < self.protocol.num_rounds
        if not self._active:
            return
        if round != self.next_round:
            raise RuntimeError(f"shadow run: round {round} began before round {self.next_round} (a resumed run)")
        self._broadcast = self.protocol.broadcast(self.state, round)
        self._reuse = self.same_client and _same_broadcast(self._broadcast, broadcast)
        self._total = None

    def chunk(self, round: int, units: Units, message: Message) -> None:
        if not self._active:
            return
        if self._reuse:
            own = message
        else:
            mine = units if self.units_map is None else self.units_map(units)
            own = client_message(self.protocol, round, self._broadcast, mine)
        self._total = own.copy() if self._total is None else self._total.add_(own)

    def end_round(self, round: int) -> None:
        if not self._active:
            return
        p = self.protocol
        # as the local runtime's round: a zero message plus the one summed reply
        total = zero_message(p.stat_specs(round), p.dtype, self._device())
        if self._total is not None:
            total = total + self._total
        self.state, _ = p.server_update(round, self.state, total, self.privatizer)
        self._total = None
        self.next_round += 1

    def _device(self) -> torch.device:
        if self._total is not None:
            return next(iter(self._total.stats.values())).device
        return torch.device("cpu")


class ReferenceRun(Companion):
    """The non-private AltMin reference (:class:`~fedpers.experiments.common.lowrank_baselines.NonPrivateAltMin`)
    advanced one pass per round of a run that reads every user, with all of its samples, in each
    round, in the chunks the reference's own passes read: its spectral pass in the run's round 0,
    its round r in the run's round r, so its first passes cost no generation of their own. Its
    caller finishes it with ``nonprivate_altmin(…, resume=reference.steps)``; the U is the one
    ``nonprivate_altmin`` computes alone, bit for bit. Valid (:attr:`usable`) only if it saw the
    run from round 0 on and every round's pass ended."""

    def __init__(self, rank: int, units_map: Callable[[Units], Units] | None = None) -> None:
        self.steps = NonPrivateAltMin(rank)
        self.units_map = units_map
        self.next_round = 0
        self._open = False

    @property
    def usable(self) -> bool:
        return not self.error and not self._open

    def start_round(self, round: int, broadcast: Mapping[str, Tensor]) -> None:
        if round != self.next_round:
            raise RuntimeError(f"reference: round {round} began before round {self.next_round} (a resumed run)")
        self._open = not self.steps.done
        if self._open:
            self.steps.begin()

    def chunk(self, round: int, units: Units, message: Message) -> None:
        if self._open:
            self.steps.add(units if self.units_map is None else self.units_map(units))

    def end_round(self, round: int) -> None:
        if self._open:
            self.steps.end()
        self._open = False
        self.next_round += 1
