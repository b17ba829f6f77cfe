"""Plants each privacy wiring mistake in a scratch copy and shows which tests catch it.

    python tests/mutation_check.py            # every mutation; exits 1 if one goes uncaught

Not collected by pytest (it runs pytest itself, once per mutation, ~1 min each on 2 cores).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALTMIN = "fedpers/protocols/altmin.py"
TESTS = ["tests/test_privacy_e2e.py", "tests/test_ledger_params.py", "tests/test_altmin.py"]

MUTATIONS: dict[str, tuple[str, str, str]] = {
    "A clip removed": (
        ALTMIN,
        "A, b = linalg.kron_statistics(v_hat, x2, log_v, self.eta, label=",
        "A, b = linalg.kron_statistics(v_hat, x2, log_v, math.inf, label=",
    ),
    "init label clip removed": (
        "fedpers/linalg.py",
        "coef = clip_scalar(y[:, 0::2], label_clip) * clip_scalar(y[:, 1::2], label_clip)",
        "coef = y[:, 0::2] * y[:, 1::2]",
    ),
    "b label clip removed": (
        ALTMIN,
        "label=linalg.clip_scalar(y[:, q : 2 * q], self.zeta))",
        "label=y[:, q : 2 * q])",
    ),
    "A noised with b's bound": (
        ALTMIN,
        'summed.stats["A"], per_unit_bound=self.a_bound,',
        'summed.stats["A"], per_unit_bound=self.b_bound,',
    ),
    "disjoint cohort filter removed": (
        ALTMIN,
        "            keep = self.cohort_of(ids) == round\n            x, y = x[keep], y[keep]\n",
        "            keep = self.cohort_of(ids) == round\n",
    ),
}


def failing_tests(tree: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rf", *TESTS],
        cwd=tree, env=env, capture_output=True, text=True,
    ).stdout
    return [line.split(" ")[1] for line in out.splitlines() if line.startswith("FAILED ")]


def main() -> int:
    uncaught = []
    for name, (path, old, new) in MUTATIONS.items():
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__", "*.egg-info"))
            source = (tree / path).read_text()
            if source.count(old) != 1:
                raise SystemExit(f"{name}: the code to mutate is not found once in {path}")
            (tree / path).write_text(source.replace(old, new))
            failed = failing_tests(tree)
        print(f"{name}: {len(failed)} failing test(s)")
        for test in failed:
            print(f"    {test}")
        if not failed:
            uncaught.append(name)
    if uncaught:
        print(f"NOT CAUGHT: {uncaught}")
    return 1 if uncaught else 0


if __name__ == "__main__":
    raise SystemExit(main())
