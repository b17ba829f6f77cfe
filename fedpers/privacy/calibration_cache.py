"""An on-disk cache of solved noise multipliers, so a repeated config skips the calibration solve.

An entry is keyed by everything the solve reads: the calibration key (the event's shape, the
target (ε, δ), the accountant), the PLD grids and steps, the source of the accountant's code and
the versions of the libraries it calls. It holds the solved multiplier bit for bit
(``float.hex``). A missing, unreadable, corrupt or foreign entry is a miss: the caller solves
again, so the cache can make a calibration faster but never change its answer. The caller still
checks ε ≤ target at full resolution for a cached multiplier (see
:func:`fedpers.privacy.accountant.calibrate_noise_multiplier`).

Where: ``$FEDPERS_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedpers``, else ``~/.cache/fedpers``
(in a ``calibrations`` folder); ``FEDPERS_CALIBRATION_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

CACHE_DIR_ENV = "FEDPERS_CACHE_DIR"
DISABLE_ENV = "FEDPERS_CALIBRATION_CACHE"
"""Set to ``0`` (or ``off``, ``false``, ``no``) to neither read nor write the cache."""
FORMAT = 1
LIBRARIES = ("dp-accounting", "numpy", "scipy")
"""The libraries whose arithmetic a solve depends on; their versions are part of every key."""


def cache_dir() -> Path | None:
    """The folder of the calibration entries, or None when the cache is turned off."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    base = os.environ.get(CACHE_DIR_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "fedpers") if xdg else str(Path.home() / ".cache" / "fedpers")
    return Path(base) / "calibrations"


@lru_cache(maxsize=1)
def _library_versions() -> tuple[str, ...]:
    from importlib import metadata

    versions = []
    for name in LIBRARIES:
        try:
            versions.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name}=?")
    return tuple(versions)


@lru_cache(maxsize=16)
def _source_digest(paths: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return digest.hexdigest()


def entry_key(calibration: str, settings: Sequence[object], sources: Sequence[str]) -> str:
    """The full key of one solve: ``calibration`` (its :func:`calibration_key`), the solver's
    ``settings`` (grids, steps) and the digest of the ``sources`` (files) of the code that solves."""
    return json.dumps(
        {
            "format": FORMAT,
            "calibration": calibration,
            "settings": [repr(s) for s in settings],
            "sources": _source_digest(tuple(sources)),
            "libraries": list(_library_versions()),
        },
        sort_keys=True,
    )


def _path(folder: Path, key: str) -> Path:
    return folder / (hashlib.sha256(key.encode()).hexdigest() + ".json")


def lookup(key: str) -> float | None:
    """The multiplier stored under ``key``, or None (no entry, cache off, or any fault in the entry)."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        entry = json.loads(_path(folder, key).read_text())
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("z"), str):
            return None
        z = float.fromhex(entry["z"])
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return z if math.isfinite(z) and z > 0.0 else None


def store(key: str, z: float) -> None:
    """Keep ``z`` under ``key`` (written whole, then renamed into place); a cache that cannot be
    written is skipped silently: it only ever saves time."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # a folder made here is the user's alone
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "z": float(z).hex()}, f)
            os.replace(tmp, _path(folder, key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return
