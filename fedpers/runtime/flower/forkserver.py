"""`fedpers deploy superexec` / `supernode`: Flower's SuperExec with a warm fork server for
ClientApps, and Flower's SuperNode with a shorter message poll.

Flower 1.41 runs every message of a deployment in a fresh ``flwr-clientapp`` process that
imports Python, flwr, torch and fedpers again (2.5–5 s here) — most of a deployment round.
This runs Flower's own SuperExec loop (``flower-superexec``, same flags) for a SuperNode
started with ``--isolation process``, but launches each ClientApp task by forking a process
that has already imported all of that: the fork runs Flower's own ``run_clientapp`` with the
task's one-time token, exactly what ``flwr-clientapp --token`` runs, and exits. The fork server
is a separate process with no gRPC channel open (forking a process with live channels is
unsafe); the SuperExec hands it each task's spec on a pipe. Other task types keep Flower's
subprocess executor.

It also shortens the SuperExec's task poll from Flower's 1 s to 0.05 s
(``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, unless set). Tied to Flower 1.41's internals
(``run_superexec.get_executor``, ``run_clientapp``); refused on another minor version.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

FLOWER_SERIES = "1.41."
POLL_INTERVAL = "0.05"


def serve() -> None:
    """The fork server: import once, then fork one child per JSON line on stdin."""
    import torch  # noqa: F401 - imported once here so every fork has it
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    import fedpers.runtime.flower.client  # noqa: F401 - the ClientApp's code, warm
    import fedpers.experiments  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    print("ready", flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        if os.fork() == 0:  # the child: one ClientApp execution, as flwr-clientapp --token runs it
            code = 0
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                run_clientapp(
                    runtime_api_address=spec["runtime_api_address"], token=spec["token"], insecure=spec["insecure"],
                    certificates=validate_and_resolve_root_certificates(spec["root_certificates_path"], spec["insecure"]),
                    parent_pid=spec["parent_pid"], runtime_dependency_install=spec["runtime_dependency_install"],
                )
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0
            except BaseException:  # noqa: BLE001 - a child must never return into the server loop
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)


class ForkServerExecutor:
    """Flower's executor interface: ClientApp tasks go to the fork server, others to Flower's default."""

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback
        self.server = subprocess.Popen([sys.executable, "-m", "fedpers.runtime.flower.forkserver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.server.stdout.readline().strip() if self.server.stdout else ""
        if ready != "ready":
            raise RuntimeError(f"fedpers fork server did not start (said {ready!r})")

    def launch(self, spec: Any) -> Any:
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP or self.server.poll() is not None:
            return self.fallback.launch(spec)
        line = {k: getattr(spec, k) for k in ("runtime_api_address", "token", "insecure", "root_certificates_path", "parent_pid", "runtime_dependency_install")}
        assert self.server.stdin is not None
        self.server.stdin.write(json.dumps(line) + "\n")
        self.server.stdin.flush()
        print(f"fedpers superexec: forked a warm ClientApp for task {spec.task_id}", file=sys.stderr, flush=True)
        return LaunchResult.accepted()

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.terminate()
        self.fallback.close()

    def __getattr__(self, name: str) -> Any:  # capacity checks, reconcile: as Flower's executor
        return getattr(self.fallback, name)


def _require_flower(command: str) -> None:
    """Refuse a Flower other than the series whose internals these wrappers patch."""
    import flwr

    version = getattr(flwr, "__version__", "")
    if not version.startswith(FLOWER_SERIES):
        raise SystemExit(f"fedpers deploy {command} is written against Flower {FLOWER_SERIES}x; this is flwr {version}: use flower-{command}")


def superexec(argv: list[str]) -> int:
    """``flower-superexec ARGV`` with :class:`ForkServerExecutor` for ClientApp tasks."""
    import importlib

    _require_flower("superexec")
    cli = importlib.import_module("flwr.supercore.cli.flower_superexec")
    loop = importlib.import_module("flwr.supercore.superexec.run_superexec")
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", POLL_INTERVAL)
    original = loop.get_executor
    loop.get_executor = lambda *a, **k: ForkServerExecutor(original(*a, **k))
    sys.argv = ["flower-superexec", *argv]
    cli.flower_superexec()
    return 0


SUPERNODE_POLL = 0.2
"""Seconds between a SuperNode's pulls for messages with ``fedpers deploy supernode`` (Flower: 3 s)."""


class _PollingTime:
    """``time`` for Flower's SuperNode loop with every wait capped at ``poll`` seconds: its
    only sleeps are polls (3 s when no message was pulled, 0.5 s while a reply is pending)."""

    def __init__(self, poll: float) -> None:
        import time

        self._time, self._poll = time, poll

    def sleep(self, seconds: float) -> None:
        self._time.sleep(min(seconds, self._poll))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._time, name)


def supernode(argv: list[str]) -> int:
    """``flower-supernode ARGV`` polling the SuperLink every ``--poll`` s (default 0.2) instead of
    Flower 1.41's hard-coded 3 s, the floor of a deployment round (each idle SuperNode then sends
    about 1/poll pull requests a second)."""
    import importlib

    _require_flower("supernode")
    poll = SUPERNODE_POLL
    if "--poll" in argv:
        i = argv.index("--poll")
        try:
            poll = float(argv[i + 1])
        except (IndexError, ValueError):
            raise SystemExit("--poll needs a number of seconds") from None
        if not 0.01 <= poll <= 3.0:
            raise SystemExit(f"--poll must be in [0.01, 3] seconds; got {poll}")
        argv = argv[:i] + argv[i + 2:]
    loop = importlib.import_module("flwr.supernode.start_client_internal")
    loop.time = _PollingTime(poll)
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")
    sys.argv = ["flower-supernode", *argv]
    cli.flower_supernode()
    return 0


if __name__ == "__main__":
    serve()
