"""Host↔device traffic that does not make the host wait, and checks read once per round.

On a GPU the host queues kernels and runs ahead of them; it waits (a *sync*) whenever it needs a
value the device computes (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``nonzero``, a
LAPACK error check) and after every blocking copy to the device (PyTorch synchronises the stream
after it). A round made of many small steps, each deciding the next on the host, then runs at the
speed of those waits, not of the device. This module is how the device path avoids them:

* :func:`to_device` copies host tensors (ids, bookkeeping, a broadcast) without waiting: a
  non-blocking copy from pinned memory, ordered on the stream before every kernel queued after it.
* :func:`to_host` brings several tensors to the host in one copy: one wait for all of them.
* :class:`Checks` holds the assumptions a computation made *instead of* reading a value (norms in
  the trusted range, every Cholesky factorisation succeeded, every unit of a chunk in the round, a
  message finite), ANDed on the device into one flag. The local runtime reads it once per round,
  with the round's summed message; a round whose assumptions did not all hold is made again with
  every check read as it comes (the per-chunk code, the same bits as a run that never deferred).

On the CPU nothing waits, so nothing here changes what a CPU run computes: :func:`to_device` to the
CPU is ``.to``, and no runtime defers checks on the CPU unless asked to (tests do, to compare).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

Tensor = torch.Tensor


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``, the host not waiting for the copy: a host tensor bound for a GPU is pinned
    and copied non-blocking (the caching host allocator keeps the pinned buffer until the copy is
    done, so the caller may drop ``t`` at once); every other move is ``t.to(device)``."""
    device = torch.device(device)
    if t.device.type == device.type and (device.index is None or t.device.index == device.index):
        return t
    if t.device.type != "cpu" or device.type == "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors on the host, bit for bit, in one device→host copy (one wait, not one per tensor):
    their bytes are concatenated on the device, copied, and cut back into tensors of their own
    dtypes and shapes. Host tensors are returned as they are."""
    on_device = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    out = list(tensors)
    if not on_device:
        return out
    if len(on_device) == 1:
        out[on_device[0]] = tensors[on_device[0]].cpu()
        return out
    # widest elements first: every tensor then starts at a multiple of its element size (view(dtype) needs it)
    on_device.sort(key=lambda i: -tensors[i].element_size())
    flat = [tensors[i].detach().contiguous().reshape(-1).view(torch.uint8) for i in on_device]
    host = torch.cat(flat).cpu()
    start = 0
    for i, part in zip(on_device, flat):
        t = tensors[i]
        stop = start + part.numel()
        out[i] = host[start:stop].view(t.dtype).reshape(t.shape)
        start = stop
    return out


class Checks:
    """Assumptions a device computation made instead of reading values on the host, as one 0-dim
    bool on the device: True while every one held (:meth:`expect`). Read once by the runtime
    (:attr:`flag`); a False means the round is made again with every check read on the spot."""

    def __init__(self) -> None:
        self.flag: Tensor | None = None
        self.count = 0

    def expect(self, holds: Tensor) -> None:
        """Record a 0-dim bool that must be True for the computation to be the one the checks
        read on the host would have chosen."""
        holds = holds.reshape(())
        self.flag = holds.clone() if self.flag is None else self.flag.logical_and_(holds)
        self.count += 1


_ACTIVE = threading.local()


@contextlib.contextmanager
def deferring(checks: Checks | None) -> Iterator[Checks | None]:
    """Within the block, code of this thread that would read a check on the host records it in
    ``checks`` instead (:func:`pending`) and goes on as if it held; None: read as usual. Threads
    of a pool do not see it and read their checks as usual (the same results, with waits)."""
    outer = getattr(_ACTIVE, "checks", None)
    _ACTIVE.checks = checks
    try:
        yield checks
    finally:
        _ACTIVE.checks = outer


def pending() -> Checks | None:
    """The :class:`Checks` this thread's code records its checks in (None: read them on the host)."""
    return getattr(_ACTIVE, "checks", None)
