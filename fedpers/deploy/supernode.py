"""`fedpers deploy supernode`: Flower's SuperNode with shorter waits, starting ``fedpers deploy superexec`` (Flower internals: gated).

``flower-supernode`` polls the SuperLink every 3 s and checks for a ClientApp's reply every 0.5 s,
both hard-coded in ``start_client_internal`` (no option in Flower 1.41 or 1.42). This runs it
polling every 0.2 s when idle (``--poll``), every 20 ms growing back to that after each message
it worked on, and checking every 5 ms and, with Flower's default
``--isolation subprocess``, starting ``fedpers deploy superexec`` as its SuperExec: one command
per node. With Flower's public ``--isolation process`` the SuperExec is started beside it by the
operator instead. Refused on a Flower series not checked in :mod:`.flower`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from typing import Any

from fedpers.deploy.flower import require_flower
from fedpers.deploy.forkserver import TRUSTED_APPS_ENV, take_trusted
from fedpers.deploy.isolation import python, reexec_isolated
from fedpers.deploy.pulls import quick_object_pulls

SUPERNODE_POLL = 0.2
"""Seconds between an idle SuperNode's pulls for messages with ``fedpers deploy supernode`` (Flower: 3 s)."""

BUSY_POLL, POLL_GROWTH = 0.02, 1.25
"""After the node has worked on a message it asks again after :data:`BUSY_POLL` s, each wait
:data:`POLL_GROWTH` times the previous up to the idle poll: the next round's task usually
arrives within a second of a reply (about 10 pulls to get back to 0.2 s, against 5 a second
at 0.2 s)."""

LOCAL_WAIT = 0.005
"""Seconds between a SuperNode's checks of its own state for a ClientApp's reply (Flower: 0.5 s)."""


class _PollingTime:
    """``time`` for Flower's SuperNode loop with shorter waits. Its only sleeps are the 3 s
    wait before asking the SuperLink again for a message (a network poll) and 0.5 s waits for
    a ClientApp's reply in the node's own state (local: capped at :data:`LOCAL_WAIT`). A
    network poll waits :data:`BUSY_POLL` s right after a local wait (the node has just sent a
    reply, and the next task of a round-based app follows it), each following one
    :data:`POLL_GROWTH` times longer, up to ``poll``."""

    def __init__(self, poll: float) -> None:
        import time

        self._time, self._poll = time, poll
        self._next = poll  # idle until the node has worked on a message

    def sleep(self, seconds: float) -> None:
        if seconds < 3:  # waiting for a ClientApp's reply: the node is busy with a message
            self._next = min(BUSY_POLL, self._poll)
            self._time.sleep(min(seconds, LOCAL_WAIT))
            return
        wait, self._next = self._next, min(self._next * POLL_GROWTH, self._poll)
        self._time.sleep(min(seconds, wait))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._time, name)


class _WarmSuperExecLauncher:
    """``subprocess`` for Flower's SuperNode: with ``--isolation subprocess`` (Flower's default)
    the SuperNode starts ``flower-superexec ARGS`` itself; this starts ``fedpers deploy superexec
    ARGS`` instead, so one command per node gives warm forked ClientApps."""

    def Popen(self, command: list[str], *args: Any, **kwargs: Any) -> subprocess.Popen:
        if command and command[0] == "flower-superexec":
            command = python("-m", "fedpers", "deploy", "superexec", *command[1:])
        return subprocess.Popen(command, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def supernode(argv: list[str]) -> int:
    """``flower-supernode ARGV`` polling the SuperLink every ``--poll`` s (default 0.2) when idle
    instead of Flower 1.41's hard-coded 3 s, the floor of a deployment round (each idle SuperNode
    then sends about 1/poll pull requests a second), and sooner right after a message
    (:class:`_PollingTime`); with ``--isolation subprocess`` (the default) its
    SuperExec is ``fedpers deploy superexec``."""
    require_flower("supernode")
    reexec_isolated(["fedpers", "deploy", "supernode", *argv])
    argv = take_trusted(argv)
    if os.environ.get(TRUSTED_APPS_ENV) and "process" in argv and argv[argv.index("process") - 1] == "--isolation":
        print(
            "fedpers deploy supernode: with --isolation process, give --trust-app to the SuperExec started beside it",
            file=sys.stderr,
        )
    poll = SUPERNODE_POLL
    if "--poll" in argv:
        i = argv.index("--poll")
        try:
            poll = float(argv[i + 1])
        except (IndexError, ValueError):
            raise SystemExit("--poll needs a number of seconds") from None
        if not 0.01 <= poll <= 3.0:
            raise SystemExit(f"--poll must be in [0.01, 3] seconds; got {poll}")
        argv = argv[:i] + argv[i + 2 :]
    loop = importlib.import_module("flwr.supernode.start_client_internal")
    loop.time = _PollingTime(poll)  # type: ignore[attr-defined]  # patches a private flwr module (gated)
    loop.subprocess = _WarmSuperExecLauncher()  # type: ignore[attr-defined]  # patches a private flwr module (gated)
    quick_object_pulls(loop)
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")
    sys.argv = ["flower-supernode", *argv]
    cli.flower_supernode()
    return 0
