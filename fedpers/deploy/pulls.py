"""Shorter waits for a Flower message's objects that have not arrived yet (Flower internals: gated).

Flower 1.41 and 1.42 send a message's header before its contents (its "objects"); whoever pulls the
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

from fedpers.deploy.flower import supported

FIRST_BACKOFF = 0.01
BACKOFF_CAP = 0.1
PULLERS = ("pull_objects", "pull_and_inflate_object_from_tree")


def quick_object_pulls(module: ModuleType) -> bool:
    """Replace ``module``'s imported Flower pull functions by ones with short retry waits
    (idempotent; a caller's own backoff arguments still win). Returns False, changing nothing, on
    a Flower series not in :data:`~fedpers.deploy.flower.SUPPORTED_SERIES`, whose pull functions
    may take other arguments (the run is then as fast as Flower's defaults make it)."""
    if not supported():
        return False
    for name in PULLERS:
        pull = getattr(module, name, None)
        if pull is None or getattr(pull, "fedpers_quick", False):
            continue
        quick = functools.partial(
            pull, initial_backoff=FIRST_BACKOFF, backoff_cap=BACKOFF_CAP, max_tries_per_object=None
        )
        quick.fedpers_quick = True  # type: ignore[attr-defined]
        setattr(module, name, quick)
    return True


def quick_grid_pulls(grid: object) -> bool:
    """:func:`quick_object_pulls` for the module of a deployed ServerApp's Grid (Flower's
    ``HttpGrid``, which pulls reply objects); warns once and changes nothing on an unchecked series."""
    import logging
    import sys

    if quick_object_pulls(sys.modules[type(grid).__module__]):
        return True
    from fedpers.deploy.flower import SUPPORTED_SERIES, flower_version

    logging.getLogger("fedpers.flower").warning(
        "flwr %s is not one of the series %s whose object pulls fedpers shortens: the ServerApp waits for replies with Flower's defaults",
        flower_version(),
        SUPPORTED_SERIES,
    )
    return False
