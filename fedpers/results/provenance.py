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


def provenance() -> dict[str, Any]:
    """Recorded at the start of every run and sweep (library versions read without importing them)."""
    code = _process_code()
    return {
        "fedpers": code["fedpers"],
        "git": dict(code["git"]) if code["git"] is not None else None,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else [],
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
