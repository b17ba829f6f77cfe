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

In a warm fork server (:mod:`fedpers.deploy.forkserver`) the code that runs was imported when the
server started, before any FAB was seen, so comparing files on disk at each fork would miss code
swapped in for the server's start and restored afterwards. The fork server therefore imports fedpers
through :class:`PinnedPackage`: every module is compiled from the very bytes whose SHA-256 it records
(never from ``__pycache__``), and the installed package is hashed when the server starts; each fork
compares both against the FAB's files, and a module imported later must equal the FAB's file.

Standard library only. This is drift and swap protection, not a defence against the node's operator,
who controls the node's interpreter (docs/flower.md, the threat table: what an operator with root on
their own node can still do). Bytecode in ``__pycache__`` is not compared where fedpers is imported the
usual way (Python checks it against its source's size and time only); a pinned fork server never reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any


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


class PinnedPackage:
    """A ``sys.meta_path`` finder for ``package`` (and its modules) under ``root``: each module is compiled
    from the bytes read once, whose SHA-256 is recorded in :attr:`loaded` (``__pycache__`` never read).
    :attr:`installed` is every importable file under ``root`` hashed when the pin was made; once
    :attr:`expected` is set (a FAB's files), a module whose bytes differ from it is refused at import."""

    def __init__(self, package: str, root: str | Path) -> None:
        self.package, self.root = package, Path(root).resolve()
        self.installed = package_files(self.root)
        self.loaded: dict[str, str] = {}
        self.expected: dict[str, str] | None = None

    def record(self, path: Path, data: bytes) -> None:
        """Note the bytes of ``path`` about to be compiled; refuse them if they differ from :attr:`expected`."""
        rel = path.resolve().relative_to(self.root).as_posix()
        digest = hashlib.sha256(data).hexdigest()
        if self.expected is not None and self.expected.get(rel) != digest:
            raise ModifiedCode(f"{self.package}/{rel} differs from the trusted app's; refusing to import it")
        self.loaded[rel] = digest

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.package and not name.startswith(self.package + "."):
            return None
        where = [str(self.root.parent)] if name == self.package else path
        found = importlib.machinery.PathFinder.find_spec(name, where)  # type: ignore[arg-type]
        if found is None:
            return None
        origin = Path(found.origin).resolve() if found.origin else None
        if origin is None or origin.suffix != ".py" or not origin.is_relative_to(self.root):
            raise ModifiedCode(
                f"{name} would be imported from {found.origin}, not from a source file under {self.root}"
            )
        return importlib.util.spec_from_file_location(
            name,
            origin,
            loader=_HashingLoader(name, str(origin), self),
            submodule_search_locations=found.submodule_search_locations,
        )

    def compare(self, fab: dict[str, str]) -> None:
        """Refuse (:class:`ModifiedCode`) unless the installed package (as hashed at the pin) and every module
        loaded since equal the FAB's files ``fab``; from now on every module imported must equal them too."""
        loaded = sorted(rel for rel, digest in self.loaded.items() if fab.get(rel) != digest)
        if loaded:
            raise ModifiedCode(
                f"this process runs {self.package} modules that differ from the trusted app's ({loaded[:5]}), "
                "as read when it started; refusing to run them under the app's hash"
            )
        if self.installed != fab:
            differ = _differ(fab, self.installed)
            raise ModifiedCode(
                f"the {self.package} installed at {self.root} when this process started differs from the trusted "
                f"app's ({len(differ)} files: {differ[:5]}); refusing to run it under the app's hash"
            )
        self.expected = fab


class _HashingLoader(importlib.machinery.SourceFileLoader):
    """A source loader that compiles exactly the bytes its :class:`PinnedPackage` recorded."""

    def __init__(self, fullname: str, path: str, pin: PinnedPackage) -> None:
        super().__init__(fullname, path)
        self.pin = pin

    def get_code(self, fullname: str) -> Any:
        path = self.get_filename(fullname)
        data = self.get_data(path)
        self.pin.record(Path(path), data)
        return self.source_to_code(data, path)


def pin_package(root: str | Path, own: bytes, package: str = "fedpers") -> PinnedPackage:
    """Import ``package`` from ``root`` only through a :class:`PinnedPackage` (first on ``sys.meta_path``);
    ``own``: the bytes this module was compiled from (it was loaded by path, before the pin)."""
    if package in sys.modules:
        raise ModifiedCode(f"{package} was imported before the pin: its modules' bytes were not recorded")
    pin = PinnedPackage(package, root)
    pin.record(pin.root / "deploy" / "integrity.py", own)
    sys.meta_path.insert(0, pin)
    return pin


def active_pin(package: str = "fedpers") -> PinnedPackage | None:
    """The :class:`PinnedPackage` this process imports ``package`` through, if any (a warm fork server's)."""
    for finder in sys.meta_path:
        if type(finder).__name__ == PinnedPackage.__name__ and getattr(finder, "package", None) == package:
            return finder  # type: ignore[return-value]  # the class of another load of this file
    return None


def require_fab_code(app_dir: str | Path, package: str = "fedpers") -> None:
    """Refuse (:class:`ModifiedCode`) unless ``package`` as imported here has exactly the importable
    files of ``app_dir/package`` (the installed FAB) and nothing shadows it (:func:`require_clean_startup`).
    In a pinned process (a warm fork server's fork) the comparison is with what the pin recorded when
    the process started and what it has loaded since (:meth:`PinnedPackage.compare`), not with the disk."""
    fab = (Path(app_dir) / package).resolve()
    memo: dict[Path, dict[str, str]] = {}
    require_clean_startup(fab, package, memo)
    pin = active_pin(package)
    if pin is not None:
        pin.compare(_package_files_once(memo, fab))
        return
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
