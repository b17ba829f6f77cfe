"""Shorter waits for a Flower message's objects that have not arrived yet.

Flower 1.41 sends a message's header before its contents (its "objects"); whoever pulls the
header first and finds an object missing waits 1 s, then 2, 4 ... up to 10 s before asking
again (``PULL_INITIAL_BACKOFF``, ``PULL_BACKOFF_CAP``). On a deployment round that race is the
common case: a ServerApp polling for replies, a SuperNode pulling its task, a ClientApp pulling
its message each lose about a second to it. :func:`quick_object_pulls` makes those retries start
at 10 ms and grow to 0.1 s, with the same overall time limit (``PULL_MAX_TIME``); nothing else
about a pull changes.
"""
from __future__ import annotations

import functools
from types import ModuleType

FLOWER_SERIES = "1.41."
FIRST_BACKOFF = 0.01
BACKOFF_CAP = 0.1
PULLERS = ("pull_objects", "pull_and_inflate_object_from_tree")


def quick_object_pulls(module: ModuleType) -> None:
    """Replace ``module``'s imported Flower pull functions by ones with short retry waits
    (idempotent; a caller's own backoff arguments still win). A no-op on another Flower series,
    whose pull functions may take other arguments."""
    import flwr

    if not getattr(flwr, "__version__", "").startswith(FLOWER_SERIES):
        return
    for name in PULLERS:
        pull = getattr(module, name, None)
        if pull is None or getattr(pull, "fedpers_quick", False):
            continue
        quick = functools.partial(pull, initial_backoff=FIRST_BACKOFF, backoff_cap=BACKOFF_CAP, max_tries_per_object=None)
        quick.fedpers_quick = True  # type: ignore[attr-defined]
        setattr(module, name, quick)
