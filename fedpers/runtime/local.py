"""The local runtime: every unit batched on one device, in memory-bounded chunks.

Units come either as tensors already in memory or as a :class:`~fedpers.data.units.UnitSource`
that produces any range of units on demand (synthetic users from (seed, id), rows of a file),
so a run over a million users never holds more than one chunk of their data.
"""

from __future__ import annotations

import abc
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fedpers.data.units import UnitSource
from fedpers.privacy import Privatizer
from fedpers.privacy.distributed import NodeSidePrivatizer
from fedpers.protocols.base import Message, Protocol, Units, client_message, zero_message
from fedpers.runtime.checkpoint import Checkpointer
from fedpers.runtime.driver import ClientReply, RoundRecord, drive

Tensor = torch.Tensor


class Companion(abc.ABC):
    """A computation that reads the chunks a local run reads, as it reads them (a baseline sharing
    the run's passes over the users instead of making its own).

    It sees each chunk's units and the run's message for that chunk, never changes either (the
    run's message is summed and released exactly as without it), and runs on the simulator only:
    the Flower runtime has no companions. One that raises is dropped with its error kept in
    :attr:`error`, and the run goes on: a baseline cannot stop a private run."""

    error: str = ""

    @abc.abstractmethod
    def start_round(self, round: int, broadcast: Mapping[str, Tensor]) -> None:
        """Round ``round`` begins; ``broadcast`` is what the run's clients were sent."""

    @abc.abstractmethod
    def chunk(self, round: int, units: Units, message: Message) -> None:
        """One chunk of the round's units and the run's message for it (read-only)."""

    @abc.abstractmethod
    def end_round(self, round: int) -> None:
        """Every chunk of round ``round`` has been seen."""


def _call(companions: list[Companion], method: str, *args: Any) -> None:
    for c in list(companions):
        try:
            getattr(c, method)(*args)
        except Exception as e:  # any failure of a baseline leaves the run as it is
            c.error = f"{type(e).__name__}: {e}"
            companions.remove(c)


ESTIMATE_AFTER_S = 10.0
"""Runs whose first-chunk calibration predicts more than this print their estimate first."""


def round_chunks(protocol: Protocol, round: int, chunk_size: int, n: int) -> int:
    """Chunks a round makes: of the units it reads, by the protocol's ``round_share`` (the share
    of units a round reads, when it declares one: a cohort round reads fewer), else of all n."""
    share = getattr(protocol, "round_share", None)
    units = n if share is None else math.ceil(min(1.0, max(0.0, float(share(round)))) * n)
    return max(1, -(-units // chunk_size))


def _estimate(protocol: Protocol, first_chunk_s: float, chunk_size: int, n: int, first_round: int = 0) -> None:
    """Time before cost: the client work of the run's remaining rounds from its first chunk
    (server steps and evaluation come on top), printed when it is long enough to matter."""
    chunks = [round_chunks(protocol, r, chunk_size, n) for r in range(first_round, protocol.num_rounds)]
    total = first_chunk_s * sum(chunks)
    if total > ESTIMATE_AFTER_S:
        from tqdm.auto import tqdm

        tqdm.write(
            f"{protocol.name}: about {_duration(total)} of client work ({len(chunks)} round(s), {sum(chunks)} chunk(s) of "
            f"up to {min(chunk_size, n)} units; the first chunk took {first_chunk_s:.2f} s)",
            file=sys.stderr,
        )


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 120
        else (f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h")
    )


def run_local(
    protocol: Protocol,
    units: Units | UnitSource,
    privatizer: Privatizer,
    *,
    chunk_size: int = 4096,
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    progress: bool = True,
    checkpoint: Checkpointer | None = None,
    companions: Sequence[Companion] = (),
    defer_checks: bool | None = None,
) -> tuple[Any, list[RoundRecord]]:
    """Run ``protocol`` over all ``units`` as one client, computing statistics ``chunk_size`` units at a time;
    each of ``companions`` sees every chunk of every round as it is read (:class:`Companion`).

    ``defer_checks`` (default: on a GPU, not on the CPU): the per-unit rule's finiteness check of
    each chunk's message is not read chunk by chunk (a device sync each) but once per round; a
    round where some message was not finite is made again chunk by chunk under the rule (the
    same sum as without deferring, bit for bit), so nothing non-finite is ever summed into a
    release. On the CPU a read costs nothing, and a data set with a bad unit pays no second pass."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(privatizer, NodeSidePrivatizer):  # distributed or local DP: the nodes add the noise
        from fedpers.runtime.distributed import run_local_nodes

        return run_local_nodes(
            protocol,
            units,
            privatizer,
            chunk_size=chunk_size,
            on_round=on_round,
            progress=progress,
            checkpoint=checkpoint,
        )
    source = UnitSource.of(units)
    n = source.num_units
    beside = list(companions)

    estimated = [False]

    defer = source.device.type != "cpu" if defer_checks is None else defer_checks

    def one_pass(round: int, broadcast: Mapping[str, Tensor], checked: bool) -> tuple[Message | None, bool]:
        """The round's chunks summed; ``checked``: each message under the per-unit rule as made
        (:func:`client_message`, a host read per chunk); else the finiteness flags are ANDed on the
        device and read once at the end (False: some chunk's message was not finite)."""
        message: Message | None = None
        flags: list[Tensor] = []
        ids, samples = protocol.units_needed(round, broadcast)
        chunks = max(1, -(-(n if ids is None else int(ids.numel())) // chunk_size))  # this round's, not all n's
        parts: Any = source.needed_chunks(chunk_size, ids, samples)
        if progress and chunks >= 4 and estimated[0]:  # a long round shows its chunks (with tqdm's time left)
            from tqdm.auto import tqdm

            parts = tqdm(parts, total=chunks, desc=f"round {round}", unit="chunk", leave=False, mininterval=1.0)
        _call(beside, "start_round", round, broadcast)
        for i, part_units in enumerate(parts):
            start = time.perf_counter()
            part = client_message(protocol, round, broadcast, part_units) if checked else None
            if part is None:
                try:
                    part = protocol.client_update(round, broadcast, part_units)
                except torch.linalg.LinAlgError:  # numerics that failed: the per-unit rule, now
                    part = client_message(protocol, round, broadcast, part_units)
                flag = part.finite_flag()
                if flag is not None:
                    flags.append(flag)
            message = part.copy() if message is None else message.add_(part)  # ``part`` itself stays as computed
            if progress and i == 0 and not estimated[0]:
                estimated[0] = True
                _estimate(protocol, time.perf_counter() - start, chunk_size, n, round)
            _call(beside, "chunk", round, part_units, part)
        finite = not flags or bool(torch.stack(flags).all())  # the round's one host read of its checks
        if finite:
            _call(beside, "end_round", round)
        return message, finite

    def gather(round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        message, finite = one_pass(round, broadcast, checked=not defer)
        if not finite:  # some unit's contribution was not finite: the round again, chunk by chunk
            message, _ = one_pass(round, broadcast, checked=True)
        if message is None:  # no unit in this round (an empty Poisson cohort): the zero sum, released with its noise
            message = zero_message(protocol.stat_specs(round), protocol.dtype, source.device)
        return [ClientReply("local", n, message)]

    return drive(
        protocol, gather, privatizer, on_round=on_round, progress=progress, device=source.device, checkpoint=checkpoint
    )
