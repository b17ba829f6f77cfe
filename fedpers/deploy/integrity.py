"""What runs is what was trusted: the fedpers a process imports must be the FAB's own.

A node's ``--trust-app`` names a FAB by its hash, but Python imports ``fedpers`` from wherever
it finds it first: a node with a modified fedpers on its path would run that under the trusted
app's name (a warm fork server imports it before any FAB is seen). The apps' entry modules
(``clients/client_app.py``, ``server/server_app.py``, part of the FAB) load this file by path —
not through the ``fedpers`` package, whose ``__init__`` may be the modified one — and refuse to
start unless

- every importable file of the fedpers this process imports — sources and compiled modules
  (``.so``, a sourceless ``.pyc``: Python prefers an extension module to the ``.py`` beside it) —
  equals the FAB's, which holds sources only;
- no ``PYTHONPATH`` entry holds a fedpers other than the FAB's;
- no ``sitecustomize``/``usercustomize`` runs from a ``PYTHONPATH`` entry, the user's site
  directory or anywhere outside the interpreter's own installation (code that runs before any check).

Standard library only. This is drift protection, not a defence against the node's operator, who
controls the node's interpreter (docs/flower.md, Security: what bounds a node operator). Bytecode
in ``__pycache__`` is not compared (Python checks it against its source's size and time only).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path


class ModifiedCode(RuntimeError):
    """The fedpers this process imports differs from the FAB's: the task is refused."""


def package_files(root: Path) -> dict[str, str]:
    """{relative path: SHA-256} of every file under ``root`` that Python can import (``.py``, ``.pyc``,
    extension modules; ``__pycache__`` excluded). Walks as ``Path.rglob`` does (symlinked
    directories not followed) but never enters ``__pycache__`` and stats only importable names:
    this runs in every ClientApp execution of a deployment."""
    import os

    suffixes = tuple(importlib.machinery.all_suffixes())
    found: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = Path(folder, name)
            if name.endswith(suffixes) and path.is_file():
                found[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(found.items()))


def _package_files_once(memo: dict[Path, dict[str, str]], root: Path) -> dict[str, str]:
    """:func:`package_files` of ``root``, computed once per check (the FAB's package is compared twice)."""
    key = root.resolve()
    if key not in memo:
        memo[key] = package_files(root)
    return memo[key]


def _installation() -> list[Path]:
    """The interpreter's own directories (where a lab's distribution may keep a sitecustomize)."""
    import sysconfig

    found = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            found.add(Path(sysconfig.get_paths()[key]).resolve())
    return sorted(found)


def require_clean_startup(fab: Path, package: str = "fedpers", memo: dict[Path, dict[str, str]] | None = None) -> None:
    """Refuse (:class:`ModifiedCode`) a ``sitecustomize``/``usercustomize`` from outside the
    interpreter's installation or from ``PYTHONPATH``, and a ``PYTHONPATH`` entry holding a
    ``package`` that differs from the FAB's ``fab/package``."""
    import os

    entries = [Path(e).resolve() for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    own = _installation()
    for name in ("sitecustomize", "usercustomize"):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if module is None or not file:
            continue
        where = Path(file).resolve()
        inside = any(where.is_relative_to(d) for d in own) and not any(where.is_relative_to(e) for e in entries)
        if not inside:
            raise ModifiedCode(
                f"{name} runs from {where} (outside this interpreter's installation); refusing to run the app"
            )
    memo = {} if memo is None else memo
    for entry in entries:
        candidate = entry / package
        if not candidate.is_dir() or candidate.resolve() == fab.resolve():
            continue
        want, have = _package_files_once(memo, fab), _package_files_once(memo, candidate)
        if have != want:
            raise ModifiedCode(
                f"PYTHONPATH entry {entry} holds a {package} that differs from the trusted app's "
                f"({_differ(want, have)[:5]}); refusing to run it under the app's hash"
            )


def _differ(want: dict[str, str], have: dict[str, str]) -> list[str]:
    return sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))


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
    """Refuse (:class:`ModifiedCode`) unless ``package`` as imported here has exactly the importable
    files of ``app_dir/package`` (the installed FAB) and nothing shadows it (:func:`require_clean_startup`)."""
    fab = (Path(app_dir) / package).resolve()
    memo: dict[Path, dict[str, str]] = {}
    require_clean_startup(fab, package, memo)
    used = imported_root(package)
    if used is None or used == fab:
        return
    want, have = _package_files_once(memo, fab), _package_files_once(memo, used)
    if want != have:
        differ = _differ(want, have)
        raise ModifiedCode(
            f"this process imports {package} from {used}, which differs from the trusted app's "
            f"({len(differ)} files: {differ[:5]}); refusing to run it under the app's hash"
        )
