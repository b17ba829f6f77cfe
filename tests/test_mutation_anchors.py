"""Every planted mistake of tests/mutation_check.py still finds its code: an anchor that no longer
occurs exactly once would stop that script at its row, and the mistake would go unchecked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_planted_mistake_finds_its_code_exactly_once() -> None:
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "tests" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = {
        name: (path, (ROOT / path).read_text().count(old))
        for name, (path, old, new, *_) in module.MUTATIONS.items()
        if (ROOT / path).read_text().count(old) != 1 or old == new
    }
    assert not missing, f"planted mistakes whose code is not found exactly once (or plant nothing): {missing}"
