"""The node's integrity check (fedpers/deploy/integrity.py) in a real interpreter started as a node would
be: a compiled module beside an identical trusted .py, a sitecustomize on PYTHONPATH and a PYTHONPATH
entry holding another fedpers are refused; an identical copy passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = (
    "import importlib.util as u, sys\n"
    f"spec = u.spec_from_file_location('integrity', {str(ROOT / 'fedpers' / 'deploy' / 'integrity.py')!r})\n"
    "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
    "m.require_fab_code(sys.argv[1])\n"
)


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> tuple[Path, Path]:
    """(the FAB's directory, a node's identical copy of fedpers), sources only."""
    base = tmp_path_factory.mktemp("integrity")
    for name in ("fab", "node"):
        shutil.copytree(
            ROOT / "fedpers", base / name / "fedpers", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
        )
    return base / "fab", base / "node"


def _check(fab: Path, *pythonpath: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(map(str, pythonpath))}
    return subprocess.run([sys.executable, "-c", CHECK, str(fab)], env=env, capture_output=True, text=True, timeout=120)


def test_an_identical_copy_passes(trees: tuple[Path, Path]) -> None:
    fab, node = trees
    done = _check(fab, node)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_compiled_module_beside_an_identical_trusted_py_is_refused(trees: tuple[Path, Path], tmp_path: Path) -> None:
    fab, node = trees
    shadow = tmp_path / "node"
    shutil.copytree(node, shadow)
    (
        shadow
        / "fedpers"
        / "runtime"
        / "flower"
        / f"codec{__import__('importlib.machinery').machinery.EXTENSION_SUFFIXES[0]}"
    ).write_bytes(b"\x7fELF")
    done = _check(fab, shadow)
    assert done.returncode != 0 and "ModifiedCode" in done.stderr and "runtime/flower/codec" in done.stderr, (
        done.stderr[-2000:]
    )


def test_a_sitecustomize_on_pythonpath_is_refused(trees: tuple[Path, Path], tmp_path: Path) -> None:
    fab, node = trees
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("# runs before any check: halves every reply\n")
    done = _check(fab, tmp_path / "site", node)
    assert done.returncode != 0 and "sitecustomize runs from" in done.stderr, done.stderr[-2000:]


def test_a_pythonpath_entry_with_another_fedpers_is_refused_even_behind_the_trusted_one(
    trees: tuple[Path, Path], tmp_path: Path
) -> None:
    fab, node = trees
    other = tmp_path / "other"
    shutil.copytree(node, other)
    client = other / "fedpers" / "runtime" / "flower" / "client.py"
    client.write_text(client.read_text() + "\nLEAKED = True\n")
    done = _check(fab, node, other)
    assert done.returncode != 0 and f"PYTHONPATH entry {other}" in done.stderr and "client.py" in done.stderr, (
        done.stderr[-2000:]
    )


def test_the_package_listing_is_every_importable_file_outside_pycache_as_rglob_finds_them(tmp_path: Path) -> None:
    """The walk that replaced ``rglob`` lists the same files: sources, a sourceless .pyc, an
    extension module, a symlinked file; nothing in ``__pycache__``; no symlinked directory entered."""
    import hashlib
    import importlib.machinery
    import importlib.util

    spec = importlib.util.spec_from_file_location("integrity_walk", ROOT / "fedpers" / "deploy" / "integrity.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    for rel, text in {
        "__init__.py": "a",
        "sub/m.py": "b",
        "sub/old.pyc": "c",
        "sub/fast.abi3.so": "d",
        "sub/__pycache__/m.cpython-311.pyc": "e",
        "notes.txt": "f",
    }.items():
        (pkg / rel).write_text(text)
    (outside / "x.py").write_text("g")
    (pkg / "linked.py").symlink_to(outside / "x.py")
    (pkg / "linkdir").symlink_to(outside)
    listed = m.package_files(pkg)
    suffixes = tuple(importlib.machinery.all_suffixes())
    by_rglob = {
        p.relative_to(pkg).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(pkg.rglob("*"))
        if "__pycache__" not in p.parts and p.is_file() and p.name.endswith(suffixes)
    }
    assert listed == by_rglob
    assert set(listed) == {"__init__.py", "sub/m.py", "sub/old.pyc", "sub/fast.abi3.so", "linked.py"}


# A pinned process (the warm fork server): fedpers is compiled from the bytes it hashed when the process
# started; a fork's check compares those, not the files on disk by then. PIN is the fork server's own first code.
PINNED = (
    "import fedpers.deploy.trust\n"  # a module the process loads when it starts
    "print('loaded', flush=True)\n"
    "sys.stdin.readline()\n"  # the test swaps files back here
    "import _fedpers_pin\n"
    "_fedpers_pin.require_fab_code(sys.argv[2])\n"
    "print('accepted', flush=True)\n"
    "sys.stdin.readline()\n"  # the test changes files here
    "import fedpers.deploy.appguard\n"  # a module first imported after the check
    "print('imported later', flush=True)\n"
)


def _pinned(installed: Path, fab: Path, between: object = None, after: object = None) -> subprocess.CompletedProcess:
    """A process started as the fork server starts (``python -I -c PIN``) on ``installed``/fedpers; once it has
    loaded its modules ``between()`` runs, then the process checks itself against ``fab``; then ``after()``."""
    from fedpers.deploy.forkserver import PIN
    from fedpers.deploy.isolation import isolated_env, python

    proc = subprocess.Popen(
        python("-c", PIN + PINNED, str(installed / "fedpers"), str(fab)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=isolated_env({"PATH": "/usr/bin:/bin"}),
    )
    try:
        assert proc.stdout.readline().strip() == "loaded", proc.stderr.read()[-2000:]
        if between is not None:
            between()
        proc.stdin.write("\n")
        proc.stdin.flush()
        if after is not None:
            assert proc.stdout.readline().strip() == "accepted", proc.stderr.read()[-2000:]
            after()
        out, err = proc.communicate("\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_pinned_process_on_the_trusted_code_passes(trees: tuple[Path, Path]) -> None:
    fab, node = trees
    done = _pinned(node, fab)
    assert done.returncode == 0 and done.stdout.split() == ["accepted", "imported", "later"], done.stderr[-2000:]


def test_code_swapped_in_for_the_start_and_restored_is_refused(trees: tuple[Path, Path], tmp_path: Path) -> None:
    """trust.py modified while the process starts, restored before the check: the files on disk equal the
    FAB again, but the bytes that were compiled did not (the unpinned check compared the disk and passed)."""
    fab, node = trees
    installed = tmp_path / "installed"
    shutil.copytree(node, installed)
    trust = installed / "fedpers" / "deploy" / "trust.py"
    honest = trust.read_text()
    trust.write_text(honest + "\nLEAKED = True  # swapped in for the start\n")
    done = _pinned(installed, fab, between=lambda: trust.write_text(honest))
    assert done.returncode != 0 and "ModifiedCode" in done.stderr and "deploy/trust.py" in done.stderr, done.stderr[
        -2000:
    ]
    assert "accepted" not in done.stdout


def test_a_module_that_differs_on_disk_is_refused_whether_loaded_at_the_start_or_later(
    trees: tuple[Path, Path], tmp_path: Path
) -> None:
    """A file the process has not loaded yet, modified before it starts: refused by the hash of the installed
    package taken at the start; modified after the check passed: refused when it is imported."""
    fab, node = trees
    installed = tmp_path / "installed"
    shutil.copytree(node, installed)
    client = installed / "fedpers" / "runtime" / "flower" / "client.py"
    honest = client.read_text()
    client.write_text(honest + "\nLEAKED = True\n")
    done = _pinned(installed, fab)
    assert done.returncode != 0 and "installed at" in done.stderr and "runtime/flower/client.py" in done.stderr, (
        done.stderr[-2000:]
    )
    client.write_text(honest)
    guard = installed / "fedpers" / "deploy" / "appguard.py"
    done = _pinned(installed, fab, after=lambda: guard.write_text(guard.read_text() + "\nLEAKED = True\n"))
    assert done.returncode != 0 and "deploy/appguard.py differs from the trusted app's" in done.stderr, done.stderr[
        -2000:
    ]
    assert "imported later" not in done.stdout
