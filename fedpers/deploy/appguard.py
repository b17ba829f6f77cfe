"""The SuperLink side of ``--trust-app``: a SuperExec that starts only the ServerApps the lab listed.

Flower runs a submitted app's ServerApp on the SuperLink's machine whatever the nodes think of its
ClientApp. With ``flower-superlink --isolation process`` the lab starts the SuperExec itself
(``fedpers deploy superexec --trust-app SHA256 ...``, with the SuperExec shared secret); every
ServerApp task starts ``flwr-serverapp`` through :func:`main`, which checks the SHA-256 of the
FAB's bytes before Flower extracts or imports anything from it and otherwise fails the task (the
run ends ``finished:failed`` at once; a refused launch would leave it pending until Flower's task
expiry) — the node side's check (:mod:`fedpers.deploy.forkserver`), mirrored.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

TOKEN_STDIN = "--fedpers-token-stdin"
"""Stands for ``--token TOKEN`` on the guard's command line: the token comes on its standard input."""


def hide_token(command: list[str]) -> tuple[list[str], str | None]:
    """``command`` with ``--token TOKEN`` replaced by :data:`TOKEN_STDIN`, and the token (None if absent).

    Flower's executor puts a ServerApp's task token on its command line, which every local user reads
    in ``/proc/PID/cmdline``; whoever has it can use the Runtime API as that run."""
    if "--token" not in command[:-1]:
        return command, None
    i = command.index("--token")
    return [*command[:i], TOKEN_STDIN, *command[i + 2 :]], command[i + 1]


def start_with_token(command: list[str], token: str | None, *args: Any, **kwargs: Any) -> Any:
    """``subprocess.Popen(command)`` with ``token`` written to its standard input (a pipe only it reads)."""
    import subprocess

    if token is None:
        return subprocess.Popen(command, *args, **kwargs)
    proc = subprocess.Popen(command, *args, **{**kwargs, "stdin": subprocess.PIPE})
    assert proc.stdin is not None
    os.write(proc.stdin.fileno(), token.encode() + b"\n")  # bytes, whatever mode the caller's kwargs chose
    proc.stdin.close()
    proc.stdin = None  # nothing more goes that way (communicate() would flush it)
    return proc


def token_from_stdin(argv: list[str]) -> list[str]:
    """``argv`` with :data:`TOKEN_STDIN` replaced by ``--token`` and the line read from standard input
    (only in this process's ``sys.argv``: ``/proc/PID/cmdline`` keeps what was exec'd)."""
    if TOKEN_STDIN not in argv:
        return argv
    token = sys.stdin.buffer.readline(4096).decode().strip()
    if not token:
        raise SystemExit("fedpers appguard: no task token on standard input")
    i = argv.index(TOKEN_STDIN)
    return [*argv[:i], "--token", token, *argv[i + 1 :]]


class _GuardedLauncher:
    """``subprocess`` for Flower's subprocess executor: ``flwr-serverapp ARGS`` becomes
    ``python -m fedpers.deploy.appguard ARGS`` with its task token on a pipe, not on its command line;
    everything else is untouched."""

    def Popen(self, command: list[str], *args: Any, **kwargs: Any) -> Any:
        import subprocess

        if command and command[0] == "flwr-serverapp":
            from fedpers.deploy.isolation import isolated_env, python

            hidden, token = hide_token(python("-m", "fedpers.deploy.appguard", *command[1:]))
            return start_with_token(
                hidden, token, *args, **{**kwargs, "env": isolated_env(kwargs.get("env") or os.environ)}
            )
        return subprocess.Popen(command, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        import subprocess

        return getattr(subprocess, name)


def launch_serverapp(fallback: Any, spec: Any, trusted: frozenset[str]) -> Any:
    """Flower's launch of a ServerApp task, always through :func:`main` (which refuses an unlisted FAB)."""
    if spec.fab_hash and spec.fab_hash.lower() not in trusted:
        # Refusing the launch here would leave the run pending until Flower's task expiry; the guard
        # process below refuses it before the FAB is extracted and the run ends finished:failed.
        print(
            f"fedpers superexec: ServerApp of FAB {spec.fab_hash} is not in --trust-app: the guard refuses it",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"fedpers superexec: ServerApp task {spec.task_id} of FAB {spec.fab_hash or '(hash checked in the process)'} started through fedpers.deploy.appguard",
        file=sys.stderr,
        flush=True,
    )
    module = importlib.import_module("flwr.supercore.superexec.executor.subprocess_executor")
    original = module.subprocess
    setattr(module, "subprocess", _GuardedLauncher())  # noqa: B010 - a module global, patched for this launch only
    try:
        return fallback.launch(spec)
    finally:
        setattr(module, "subprocess", original)  # noqa: B010


def main(argv: list[str]) -> None:
    """``flwr-serverapp ARGV`` whose FAB installation first checks the FAB's SHA-256."""
    import hashlib

    from fedpers.deploy.trust import (
        TRUSTED_APPS_ENV,
        UntrustedApp,
        trusted_apps,
    )

    argv = token_from_stdin(argv)
    trusted = trusted_apps()
    runtime = importlib.import_module("flwr.superlink.runtime.run_serverapp")
    install = runtime.install_from_fab

    def checked(fab: Any, *args: Any, **kwargs: Any) -> Any:
        from pathlib import Path

        digest = hashlib.sha256(fab if isinstance(fab, bytes) else Path(fab).read_bytes()).hexdigest()
        if not trusted or digest not in trusted:
            print(f"fedpers: refused ServerApp of FAB {digest}: not in {TRUSTED_APPS_ENV}", file=sys.stderr, flush=True)
            raise UntrustedApp(
                f"this SuperExec runs only the ServerApps in {TRUSTED_APPS_ENV}; FAB {digest} is not one of them"
            )
        print(f"fedpers: ServerApp of trusted FAB {digest}", file=sys.stderr, flush=True)
        return install(fab, *args, **kwargs)

    setattr(runtime, "install_from_fab", checked)  # noqa: B010 - the module global run_serverapp calls
    cli = importlib.import_module("flwr.superlink.cli")
    sys.argv = ["flwr-serverapp", *argv]
    cli.flwr_serverapp()


if __name__ == "__main__":
    main(sys.argv[1:])
