"""Every Python process ``fedpers deploy`` starts runs isolated from its environment and sends no telemetry.

Isolated means ``python -I``: no ``PYTHONPATH``, no ``PYTHONSTARTUP``/``PYTHONHOME`` or other ``PYTHON*``
variable, no user site directory (so no ``usercustomize``), no working directory or script directory
on ``sys.path``. What is left is the interpreter's own installation: its standard library and its
``site-packages`` (a ``sitecustomize`` there still runs — it belongs to whoever installed the
interpreter, the operator; docs/flower.md, the threat table, says what an operator can still do).
So code planted in the environment (a self-erasing ``sitecustomize`` on ``PYTHONPATH``, a ``fedpers``
in the working directory) never runs in a SuperNode, its SuperExec, the fork server, its ClientApps,
the SuperLink wrapper, the fleet proxy or a ServerApp.

``FLWR_TELEMETRY_ENABLED=0`` is set for each of them (Flower reads it when ``flwr.supercore.telemetry``
is imported, so it must be in the environment a process starts with): otherwise Flower sends an
event to its telemetry host (DNS look-up included) when each SuperNode, SuperExec, SuperLink,
ServerApp and ClientApp starts and ends — a node's participation in each round, by its timing.

Standard library only; imports nothing of fedpers (it runs before anything is trusted).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

TELEMETRY_ENV = "FLWR_TELEMETRY_ENABLED"
"""Flower's public switch for its telemetry: ``0`` in every process fedpers starts."""
PATH_ENV = ("FEDPERS_POLICY", "FEDPERS_NODE_CACHE", "FLWR_HOME")
"""Variables naming a file or directory (the lab's policy, a node's data cache, Flower's home): the
recipe gives them relative to the directory it is run from; every process gets them absolute."""


def isolated_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any ``PYTHON*`` variable, with Flower's telemetry off (``FLWR_TELEMETRY_ENABLED=0``),
    and each :data:`PATH_ENV` variable made absolute against this process's working directory, so the
    policy (and ``configs/`` beside it), cache and Flower home a deployment process starts with are the
    ones every process it starts uses, whatever directory those run in."""
    kept = {k: v for k, v in environ.items() if not k.startswith("PYTHON")}
    for name in PATH_ENV:
        if kept.get(name):
            kept[name] = os.path.abspath(kept[name])
    return {**kept, TELEMETRY_ENV: "0"}


def python(*args: str) -> list[str]:
    """The command line of an isolated Python process running ``args`` (``[sys.executable, "-I", *args]``)."""
    return [sys.executable, "-I", *args]


def is_isolated(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs as :func:`python` starts one, in an :func:`isolated_env` environment."""
    environ = os.environ if environ is None else environ
    return bool(sys.flags.isolated) and dict(environ) == isolated_env(environ)


def reexec_isolated(module_args: Sequence[str]) -> None:
    """Replace this process by ``python -I -m MODULE_ARGS`` in :func:`isolated_env`, unless it already is
    one (then return). Called first by each ``fedpers deploy`` command that runs on a deployment machine,
    so whatever the operator's shell put in the environment reaches neither it nor its children."""
    if is_isolated():
        return
    dropped = sorted(k for k in os.environ if k.startswith("PYTHON"))
    if dropped:
        print(
            f"fedpers deploy: running isolated (python -I); ignoring {', '.join(dropped)}", file=sys.stderr, flush=True
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, python("-m", *module_args), isolated_env(os.environ))
