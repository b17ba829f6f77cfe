"""What runs is what was trusted: the fedpers a process imports must be the FAB's own.

A node's ``--trust-app`` names a FAB by its hash, but Python imports ``fedpers`` from wherever
it finds it first: a node with a modified fedpers on its path would run that under the trusted
app's name (a warm fork server imports it before any FAB is seen). The apps' entry modules
(``clients/client_app.py``, ``server/server_app.py``, part of the FAB) load this file by path —
not through the ``fedpers`` package, whose ``__init__`` may be the modified one — and refuse to
start unless every ``.py`` file of the importable fedpers equals the FAB's. Standard library only.
Compiled ``.pyc`` files are not compared (see docs/flower.md, Security).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path


class ModifiedCode(RuntimeError):
    """The fedpers this process imports differs from the FAB's: the task is refused."""


def package_files(root: Path) -> dict[str, str]:
    """{relative path: SHA-256} of every ``.py`` file under ``root`` (``__pycache__`` excluded)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def imported_root(package: str = "fedpers") -> Path | None:
    """The directory ``import package`` uses in this process (already imported or not), or None."""
    file: str | None = getattr(sys.modules.get(package), "__file__", None)  # None: not imported, or no file
    if file:
        return Path(file).resolve().parent
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def require_fab_code(app_dir: str | Path, package: str = "fedpers") -> None:
    """Refuse (:class:`ModifiedCode`) unless ``package`` as imported here has exactly the ``.py``
    files of ``app_dir/package`` (the installed FAB)."""
    fab = (Path(app_dir) / package).resolve()
    used = imported_root(package)
    if used is None or used == fab:
        return
    want, have = package_files(fab), package_files(used)
    if want != have:
        differ = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise ModifiedCode(
            f"this process imports {package} from {used}, which differs from the trusted app's "
            f"({len(differ)} files: {differ[:5]}); refusing to run it under the app's hash"
        )
