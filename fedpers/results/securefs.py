"""Private files at rest: a directory only its owner can enter, files only its owner can read.

Used for what a node or the SuperLink keeps on disk that other local users must not read: a
node's cache of raw user data, the budget ledger, keys written by ``fedpers deploy certs``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeDirectory(PermissionError):
    """A directory that another local user can read, write or enter, or that this user does not own."""


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory of mode 0700 owned by this user: created so if missing, refused
    (:class:`UnsafeDirectory`) if it exists with group or other permissions or another owner —
    never silently tightened, since what it held was already exposed."""
    path = Path(path)
    try:
        path.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        pass
    st = os.stat(path, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{path} is a symbolic link; give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise UnsafeDirectory(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users can reach it; "
            f"use a new directory (it is created with 0700) or chmod 700 it after checking what it holds"
        )
    return path


def write_private(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (a complete file or the old one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
