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
from fedpers.devices import Checks, deferring, to_device, to_host
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
    :attr:`error`, and the run goes on: a baseline cannot stop a private run. A round may begin
    twice (``start_round`` again before its ``end_round``) when the runtime makes it again with every
    check read (``run_local(defer_checks=…)``): what the first attempt summed is dropped."""

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

    The server (verification, the privatised release, ``server_update``) runs on the host, the
    clients where the units are: a round's summed message comes to the host in one copy, the
    broadcast goes to the units' device without the host waiting (:mod:`fedpers.devices`), so the
    state the run returns is on the host (a 0-dim tensor of the broadcast, a public scalar the clients
    read as a number, stays there).

    ``defer_checks`` (default: off the CPU): the checks a client computation would read on the host
    chunk by chunk (a device sync each: finiteness of each chunk's message, norms in the trusted
    range, Cholesky failures, chunks holding only the round's units) are assumed to hold, recorded
    as one flag on the device (:class:`fedpers.devices.Checks`) and read once per round, with the
    summed message; a round where one did not hold is made again chunk by chunk with every check read
    as it comes, under the per-unit rule (the same sum as without deferring, bit for bit), so nothing
    non-finite is ever summed into a release. On the CPU a read costs nothing, and a data set with a
    bad unit pays no second pass."""
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

    def one_pass(
        round: int, published: Mapping[str, Tensor], broadcast: Mapping[str, Tensor], checked: bool
    ) -> tuple[Message | None, Checks | None]:
        """The round's chunks summed (on the units' device): ``published`` is the broadcast as the
        server made it (on the host: which units take part, what companions see), ``broadcast`` the
        same on the units' device (what clients compute with). ``checked``: each message under the
        per-unit rule as made (:func:`client_message`, host reads per chunk); else every check is
        deferred into the returned :class:`Checks` (read by the caller)."""
        message: Message | None = None
        checks = None if checked else Checks()
        ids, samples = protocol.units_needed(round, published)
        chunks = max(1, -(-(n if ids is None else int(ids.numel())) // chunk_size))  # this round's, not all n's
        parts: Any = source.needed_chunks(chunk_size, ids, samples)
        if progress and chunks >= 4 and estimated[0]:  # a long round shows its chunks (with tqdm's time left)
            from tqdm.auto import tqdm

            parts = tqdm(parts, total=chunks, desc=f"round {round}", unit="chunk", leave=False, mininterval=1.0)
        _call(beside, "start_round", round, published)
        with deferring(checks):
            for i, part_units in enumerate(parts):
                start = time.perf_counter()
                part = client_message(protocol, round, broadcast, part_units) if checks is None else None
                if part is None:
                    try:
                        part = protocol.client_update(round, broadcast, part_units)
                    except torch.linalg.LinAlgError:  # numerics that failed: the per-unit rule, now
                        with deferring(None):
                            part = client_message(protocol, round, broadcast, part_units)
                    flag = part.finite_flag()
                    if flag is not None and checks is not None:
                        checks.expect(flag)
                message = part.copy() if message is None else message.add_(part)  # ``part`` itself stays as computed
                if progress and i == 0 and not estimated[0]:
                    estimated[0] = True
                    _estimate(protocol, time.perf_counter() - start, chunk_size, n, round)
                _call(beside, "chunk", round, part_units, part)
        return message, checks

    def gather(round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        # to the units' device without the host waiting; public scalars (a clip bound) stay numbers on the host
        sent = {k: v if v.dim() == 0 else to_device(v, source.device) for k, v in broadcast.items()}
        message, checks = one_pass(round, broadcast, sent, checked=not defer)
        reply, held = _on_host(message, checks)  # the round's one wait: its sum and its checks together
        if not held:  # some assumption of the round did not hold: the round again, every check read as made
            message, _ = one_pass(round, broadcast, sent, checked=True)
            reply, _ = _on_host(message, None)
        _call(beside, "end_round", round)
        if reply is None:  # no unit in this round (an empty Poisson cohort): the zero sum, released with its noise
            reply = zero_message(protocol.stat_specs(round), protocol.dtype, HOST)
        return [ClientReply("local", n, reply)]

    return drive(protocol, gather, privatizer, on_round=on_round, progress=progress, device=HOST, checkpoint=checkpoint)


HOST = torch.device("cpu")


def _on_host(message: Message | None, checks: Checks | None) -> tuple[Message | None, bool]:
    """(``message`` on the host, whether every deferred check held), in one device→host copy."""
    flag = None if checks is None else checks.flag
    if message is None:
        return None, True if flag is None else bool(flag)
    names = list(message.stats)
    tensors = [message.stats[k] for k in names] + ([] if flag is None else [flag])
    host = to_host(tensors)
    held = True if flag is None else bool(host[-1])
    return Message(dict(zip(names, host[: len(names)])), message.count, message.zeroed), held
