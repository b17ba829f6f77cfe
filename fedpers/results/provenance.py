"""What produced a result: code version (and git commit when run from a checkout), command, library versions, times."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

LIBRARIES = ("torch", "numpy", "flwr", "ray", "dp-accounting", "opendp")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_state(path: Path | None = None) -> dict[str, Any] | None:
    """{commit, dirty} of the checkout holding fedpers, or None when it is not one (an installed wheel)."""
    root = path or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


LAUNCHED_BY = "FEDPERS_LAUNCHED_BY"
"""Environment variable a process that hands its run to another (``fedpers run --runtime flower`` to the
simulation's ServerApp) sets to :func:`launch_record`: the run records the command and checkout that
started it, not the Flower process it ran in (whose copy of fedpers is no git checkout)."""
SECRET_FLAGS = ("--token",)
"""Command-line flags whose value is a secret (Flower hands its app processes a task token so)."""


def command_line(argv: list[str]) -> list[str]:
    """``argv`` as recorded: the program's name, and ``<hidden>`` for the value of a secret flag."""
    if not argv or not argv[0]:
        return []
    out, hide = [Path(argv[0]).name], False
    for arg in argv[1:]:
        flag, eq, _ = arg.partition("=")
        if hide:
            out.append("<hidden>")
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}=<hidden>")
        else:
            out.append(arg)
        hide = arg in SECRET_FLAGS
    return out


def launch_record() -> str:
    """What :data:`LAUNCHED_BY` carries for this process: its command line and git state, as JSON."""
    import json

    return json.dumps({"command": command_line(sys.argv), "git": _process_code()["git"]})


def _launched_by() -> dict[str, Any] | None:
    import json
    import os

    text = os.environ.get(LAUNCHED_BY)
    if not text:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def provenance() -> dict[str, Any]:
    """Recorded at the start of every run and sweep (library versions read without importing them)."""
    code = _process_code()
    launched = _launched_by()
    git = launched.get("git") if launched is not None else code["git"]
    return {
        "fedpers": code["fedpers"],
        "git": dict(git) if isinstance(git, dict) else None,
        "command": list(launched.get("command", [])) if launched is not None else command_line(sys.argv),
        "python": code["python"],
        "platform": code["platform"],
        "libraries": dict(code["libraries"]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@functools.cache
def _process_code() -> dict[str, Any]:
    """The code this process runs, read once (two ``git`` processes and six metadata scans, about
    20 ms, which every run of a sweep paid): what the process imported at its start stays what it
    runs, whatever changes on disk later."""
    from fedpers import __version__

    return {
        "fedpers": __version__,
        "git": git_state(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": {name: _version(name) for name in LIBRARIES},
    }
