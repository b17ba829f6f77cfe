"""The import graph of fedpers/ points down the layers of docs/architecture.md and has no circles.

The layer order is written once, in ``LAYERS``; every import (module level, inside functions, or
under ``TYPE_CHECKING``) counts. Same-layer imports are allowed; a circle between any modules is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fedpers

ROOT = Path(fedpers.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("fedpers.__main__", "fedpers.commands"),  # top: what a user types (cli, audit, compare, report, privacy, tracking)
    ("fedpers.audit",),  # canary designs, published runs on every runtime, scores and bounds
    ("fedpers.sweeps",),  # grids of runs and private selection over them
    ("fedpers.deploy",),  # optional: every piece of a deployment; the only code touching Flower's private internals
    ("fedpers.runner", "fedpers.app"),  # a config becomes a plan, the plan a run on a runtime (app: Flower run-config)
    ("fedpers.experiments",),  # one module per algorithm
    (
        "fedpers.runtime",
    ),  # drive a protocol (local, flower) and enforce the lab's policy on it: never look up experiments
    ("fedpers.protocols",),
    ("fedpers.privacy",),  # the one place noise is added
    ("fedpers.linalg",),
    ("fedpers.data",),  # loaders and generators of units
    ("fedpers.configs",),  # every algorithm's config class and the runtime options: no torch, no accounting library
    # bottom: run records and leaf helpers
    (
        "fedpers",
        "fedpers.results",
        "fedpers.config",
        "fedpers.metrics",
        "fedpers.seeds",
        "fedpers.memory",
        "fedpers.pools",
        "fedpers.devices",
    ),
)
"""Top to bottom; a module may import its own layer and the layers below it. Every module of fedpers/ must
be named here, itself or through its package: the root ``fedpers`` names only ``fedpers/__init__.py``."""

KNOWN_CYCLES: set[frozenset[str]] = set()
"""Circles still to break (each must still exist: a stale entry fails the test)."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module → the fedpers modules it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    child = f"{base}.{alias.name}"
                    found.add(child if child in paths else base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        edges[name] = {m for m in found if m in paths and m != name}
    return edges


def layer(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    """Index of the layer holding ``module`` (the longest matching name wins; the bare root package
    matches only itself, so an unlisted module is never taken for the root's)."""
    best, index = -1, -1
    for i, names in enumerate(layers):
        for prefix in names:
            nested = "." in prefix and module.startswith(prefix + ".")
            if (module == prefix or nested) and len(prefix) > best:
                best, index = len(prefix), i
    if index < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return index


def unlisted(edges: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Modules of the graph that no layer names."""
    missing = []
    for module in sorted(edges):
        try:
            layer(module, layers)
        except AssertionError:
            missing.append(module)
    return missing


def upward(edges: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if layer(b, layers) < layer(a, layers))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_module_is_named_in_a_layer() -> None:
    missing = unlisted(graph())
    assert not missing, "modules in no layer (name them, or their package, in LAYERS):\n  " + "\n  ".join(missing)


def test_every_import_points_down_the_layers() -> None:
    bad = upward(graph())
    assert not bad, "imports that point up the layers:\n  " + "\n  ".join(bad)


def test_no_circles_of_imports() -> None:
    found = {frozenset(c) for c in cycles(graph())}
    new = [" <-> ".join(sorted(c)) for c in found - KNOWN_CYCLES]
    assert not new, "circles of imports:\n  " + "\n  ".join(sorted(new))
    gone = [" <-> ".join(sorted(c)) for c in KNOWN_CYCLES - found]
    assert not gone, f"known circles that are gone (delete them from KNOWN_CYCLES): {gone}"


def faces_crossed(edges: dict[str, set[str]], root: Path = ROOT) -> list[str]:
    """Imports of an algorithm package's inner module (``fedpers.experiments.altmin.plan``) from outside
    that package: another algorithm shares what it shares through the package's face
    (``fedpers.experiments.altmin``) or ``fedpers.experiments.common``, never another's internals."""
    experiments = root / "experiments"
    packages = [
        f"fedpers.experiments.{d.name}"
        for d in sorted(experiments.iterdir())
        if (d / "__init__.py").is_file() and d.name != "common"
    ]
    bad = []
    for a, targets in edges.items():
        for b in targets:
            owner = next((p for p in packages if b.startswith(p + ".")), None)
            if owner is not None and a != owner and not a.startswith(owner + "."):
                bad.append(f"{a} -> {b}")
    return sorted(bad)


def test_algorithms_share_through_faces_and_common_never_internals() -> None:
    bad = faces_crossed(graph())
    assert not bad, (
        "imports of another algorithm package's internals (use its face or experiments/common):\n  " + "\n  ".join(bad)
    )


def test_the_face_check_catches_a_sibling_reaching_inside(tmp_path: Path) -> None:
    pkg = tmp_path / "fedpers"
    for rel in (
        "__init__.py",
        "experiments/__init__.py",
        "experiments/a/__init__.py",
        "experiments/a/plan.py",
        "experiments/b.py",
    ):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    (pkg / "experiments/a/__init__.py").write_text("from fedpers.experiments.a.plan import x\n")
    (pkg / "experiments/b.py").write_text(
        "from fedpers.experiments.a.plan import x\nfrom fedpers.experiments.a import y\n"
    )
    assert faces_crossed(graph(pkg), pkg) == ["fedpers.experiments.b -> fedpers.experiments.a.plan"]


def test_the_checks_catch_an_upward_import_a_circle_and_an_unlisted_module(tmp_path: Path) -> None:
    """A planted upward import (runtime → experiments), a planted circle and a planted module that no
    layer names (beside the root package, which names only its own ``__init__``) all fail the checks."""
    pkg = tmp_path / "fedpers"
    for rel in (
        "__init__.py",
        "stray.py",
        "runtime/__init__.py",
        "runtime/local.py",
        "experiments/__init__.py",
        "experiments/a.py",
        "experiments/b.py",
    ):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    (pkg / "runtime/local.py").write_text("def f():\n    from fedpers.experiments import a\n")
    (pkg / "experiments/a.py").write_text("from fedpers.experiments import b\n")
    (pkg / "experiments/b.py").write_text("from . import a\n")
    (pkg / "stray.py").write_text("from fedpers.runtime import local\n")
    layers = (("fedpers.experiments",), ("fedpers.runtime",), ("fedpers",))
    edges = graph(pkg)
    assert unlisted(edges, layers) == ["fedpers.stray"]
    del edges["fedpers.stray"]
    assert upward(edges, layers) == ["fedpers.runtime.local -> fedpers.experiments.a"]
    assert cycles(edges) == [["fedpers.experiments.a", "fedpers.experiments.b"]]


def test_the_readme_architecture_lists_every_layer_in_order() -> None:
    """README.md's architecture picture names every unit of ``LAYERS`` (by its last name, in the
    names column), and a lower layer never appears above a higher one."""
    import re

    text = (ROOT.parent / "README.md").read_text()
    picture = text.split("## Architecture", 1)[1].split("```", 2)[1].splitlines()
    block = [re.split(r"\s{3,}", line.strip())[0] for line in picture]  # the names, not the descriptions
    seen: list[int] = []
    for names in LAYERS:
        lines = []
        for name in names:
            if name in ("fedpers", "fedpers.__main__"):
                continue
            short = name.rsplit(".", 1)[-1]
            found = [i for i, line in enumerate(block) if re.search(rf"(?<![\w.]){re.escape(short)}(?![\w])", line)]
            assert found, f"README.md's architecture picture does not name {short} ({name})"
            lines.append(found[0])
        if lines:
            seen.append(min(lines))
    assert seen == sorted(seen), f"README.md's architecture picture lists the layers out of order (first lines {seen})"


def test_seeds_and_summaries_are_leaves() -> None:
    edges = graph()
    for leaf in ("fedpers.seeds", "fedpers.results.summaries"):
        assert edges[leaf] == set(), leaf


def test_split_seed_reexported_and_streams_distinct() -> None:
    from dataclasses import dataclass

    from fedpers.runner import split_seed as old
    from fedpers.seeds import derived_seed, split_seed

    @dataclass(frozen=True)
    class C:
        seed: int = 7

    assert old is split_seed
    cfg, noise = split_seed(C())
    assert cfg.seed == derived_seed(7, "public") and noise == derived_seed(7, "dp-noise") and cfg.seed != noise != 7


def test_a_local_run_imports_neither_flower_nor_ray(tmp_path) -> None:
    """`fedpers run altmin` on the local runtime loads no flwr, ray or pyarrow (start-up stays fast)."""
    import subprocess
    import sys

    code = (
        "import sys; from fedpers.commands.cli import main; "
        f"main(['run', 'altmin', '--n-users', '400', '--quiet', '--baselines', 'none', '--out', {str(tmp_path / 'run')!r}]); "
        "print(sorted(m for m in ('flwr', 'ray', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_flower_run_and_the_apps_import_no_deploy_code() -> None:
    """A Flower run on a Grid (what a simulation's ServerApp does) and the ServerApp/ClientApp modules leave
    fedpers.deploy (Flower's private internals) unimported."""
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'tests'); import torch; "
        "from fedpers import config; from fedpers.app import make_client_app, run_flower; from fedpers.experiments import experiment; "
        "from fedpers.privacy import Privatizer; from fedpers.configs.runtime import RuntimeOptions; from flower_support import InProcessGrid; "
        "import server.server_app, clients.client_app; "
        "e = experiment('altmin'); cfg = config.build(e.config_type, {'n_users': 200, 'rounds': 1}); "
        "run_flower(e, cfg, e.protocol(cfg), Privatizer(0), RuntimeOptions(runtime='flower'), grid=InProcessGrid(make_client_app(), 2), progress=False); "
        "print(sorted(m for m in sys.modules if m.startswith('fedpers.deploy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def named_in_backticks(text: str) -> set[str]:
    """Every ``fedpers.x.y`` or ``fedpers/x/y.py`` (``clients/``, ``server/`` too) written in backticks."""
    import re

    names = set()
    for span in re.findall(r"`([^`]+)`", text):
        for token in re.findall(r"(?:fedpers|clients|server)(?:[./][A-Za-z_][A-Za-z0-9_]*)+(?:\.py)?", span):
            names.add(token)
    return names


def missing_names(names: set[str], root: Path = ROOT.parent) -> list[str]:
    """The names that are neither a file, a module or package, nor a name a module defines at top level
    (or a class's attribute: ``fedpers.privacy.mechanisms.Privatizer.gaussian_sum``)."""
    missing = []
    for name in sorted(names):
        if "/" in name:
            if not (root / name).exists():
                missing.append(name)
            continue
        parts = name.split(".")
        found = False
        for cut in range(len(parts), 0, -1):
            base = root.joinpath(*parts[:cut])
            module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if not module.is_file():
                continue
            rest = parts[cut:]
            if not rest:
                found = True
            else:
                tree = ast.parse(module.read_text())
                defined: dict[str, ast.AST] = {}
                for node in tree.body:
                    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                        defined[node.name] = node
                    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                            if isinstance(target, ast.Name):
                                defined[target.id] = node
                    elif isinstance(node, ast.ImportFrom):
                        defined.update({a.asname or a.name: node for a in node.names})
                    elif isinstance(node, ast.Import):
                        defined.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
                target = defined.get(rest[0])
                if target is not None and len(rest) == 1:
                    found = True
                elif isinstance(target, ast.ClassDef) and len(rest) == 2:
                    found = any(getattr(n, "name", None) == rest[1] for n in target.body)
            break
        if not found:
            missing.append(name)
    return missing


def test_the_architecture_names_only_modules_that_exist() -> None:
    """docs/architecture.md (what docs/contributing.md and this test's docstring point to) names real
    modules and names: a move that leaves it stale fails here."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    names = named_in_backticks(text)
    assert len(names) > 40
    assert not missing_names(names), f"docs/architecture.md names what does not exist: {missing_names(names)}"
    for names_of_layer in LAYERS:  # and every layer is on the page
        for name in names_of_layer:
            assert f"`{name}`" in text or name in ("fedpers",), f"docs/architecture.md does not name the layer {name}"


def test_the_architecture_check_catches_a_stale_name(tmp_path: Path) -> None:
    (tmp_path / "fedpers" / "a").mkdir(parents=True)
    (tmp_path / "fedpers" / "__init__.py").write_text("")
    (tmp_path / "fedpers" / "a" / "__init__.py").write_text("")
    (tmp_path / "fedpers" / "a" / "b.py").write_text("class C:\n    def m(self): ...\n\ndef f(): ...\n")
    text = (
        "`fedpers.a.b.f`, `fedpers.a.b.C.m`, `fedpers/a/b.py`; gone: `fedpers.a.c`, `fedpers.a.b.g`, `fedpers.a.b.C.n`"
    )
    assert missing_names(named_in_backticks(text), tmp_path) == ["fedpers.a.b.C.n", "fedpers.a.b.g", "fedpers.a.c"]
