"""The import graph points down: experiments never reach up into runner/sweep/cli; seeds and summaries are leaves."""
from __future__ import annotations

import ast
from pathlib import Path

import fedpers

ROOT = Path(fedpers.__file__).parent
UPPER = {"fedpers.runner", "fedpers.sweep", "fedpers.cli", "fedpers.runtime.flower"}


def _imports(path: Path) -> set[str]:
    """Every fedpers module a file imports, at top level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n == "fedpers" or n.startswith("fedpers.")}


def test_experiments_do_not_import_runner_sweep_or_flower() -> None:
    bad = {
        str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if any(m == u or m.startswith(u + ".") for u in UPPER))
        for p in (ROOT / "experiments").glob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_seeds_and_summaries_are_leaves() -> None:
    for leaf in ("seeds.py", "summaries.py"):
        assert _imports(ROOT / leaf) == set(), leaf


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
        "import sys; from fedpers.cli import main; "
        f"main(['run', 'altmin', '--n-users', '400', '--quiet', '--baselines', 'none', '--out', {str(tmp_path / 'run')!r}]); "
        "print(sorted(m for m in ('flwr', 'ray', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
