"""Host syncs and kernel launches per round of every device path, under the fake CUDA device.

Each experiment's ``--device cuda`` run goes through the local runtime under ``tests/fake_cuda.py``
(the real GPU code on CPU tensors; this file's checkout provides it) at two chunk sizes; per round it
counts the points where the host waits for the device (a read, a blocking copy, an op whose output
size or error check the host needs) and the kernels launched, and divides the launches by the
round's chunks. A sync costs a GPU its queue (the host waits for every kernel queued before it), so a
round whose syncs grow with its chunks runs at the host's speed, not the device's.

    PYTHONPATH=$PWD python benchmarks/device_syncs.py                    # this tree
    PYTHONPATH=$PWD python benchmarks/device_syncs.py --against OLD_TREE # the same counts of another tree beside it

``--against``: the same measurement with ``PYTHONPATH=OLD_TREE`` in a subprocess (its fedpers, this
checkout's fake device), printed as before → after. Counts, not times: the same on any machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SMALL = {"dim": 10, "rank": 2, "samples_per_user": 16}
PATHS: dict[str, tuple[str, dict[str, Any]]] = {
    "altmin (init + 2 disjoint rounds)": ("altmin", {"n_users": 8192, **SMALL, "dtype": "float32"}),
    "altmin, poisson cohorts": (
        "altmin",
        {"n_users": 8192, **SMALL, "dtype": "float32", "cohorts": "poisson", "sampling_rate": 0.5, "epsilon": "inf"},
    ),
    "altmin, adaptive clip, every user every round, float64": (
        "altmin",
        {"n_users": 4096, **SMALL, "cohorts": "all", "clip_rule": "adaptive"},
    ),
    "fedrep": ("fedrep", {"n_users": 4096, **SMALL, "rounds": 2, "dtype": "float32"}),
    "fedrep, poisson cohorts": (
        "fedrep",
        {
            "n_users": 4096,
            **SMALL,
            "rounds": 2,
            "dtype": "float32",
            "cohorts": "poisson",
            "sampling_rate": 0.5,
            "epsilon": "inf",
        },
    ),
    "fedrep, poisson cohorts, banded noise (amplified)": (
        "fedrep",
        {
            "n_users": 4096,
            **SMALL,
            "rounds": 4,
            "dtype": "float32",
            "cohorts": "poisson",
            "sampling_rate": 0.25,
            "noise": "banded",
            "bands": 2,
            "epsilon": 4.0,
        },
    ),
    "noisygd, pca remedy": (
        "noisygd",
        {"examples": 4096, "feature_dim": 40, "steps": 2, "epsilon": 0.5, "remedy": "pca"},
    ),
    "noisygd, cyclic cohorts, adaptive clip": (
        "noisygd",
        {
            "examples": 4096,
            "feature_dim": 40,
            "steps": 3,
            "remedy": "center",
            "cycle": 3,
            "cohorts": "cyclic",
            "clip_rule": "adaptive",
        },
    ),
    "noisygd, poisson cohorts": (
        "noisygd",
        {
            "examples": 4096,
            "feature_dim": 40,
            "steps": 2,
            "remedy": "center",
            "cohorts": "poisson",
            "sampling_rate": 0.5,
        },
    ),
    "noisygd, poisson cohorts, banded noise (amplified)": (
        "noisygd",
        {
            "examples": 4096,
            "feature_dim": 40,
            "steps": 4,
            "remedy": "center",
            "cohorts": "poisson",
            "sampling_rate": 0.25,
            "noise": "banded",
            "bands": 2,
        },
    ),
    "dpals": (
        "dpals",
        {"n_users": 2048, "n_items": 200, "rank": 4, "true_rank": 4, "steps": 2, "head_items": 150, "dtype": "float32"},
    ),
    "noisyhead, statistics": ("noisyhead", {"prompts": 4096, "dim": 4}),
    "noisyhead, rounds": ("noisyhead", {"prompts": 4096, "dim": 4, "mode": "rounds", "steps": 3}),
    "noisyhead, rounds, poisson cohorts, banded noise (amplified)": (
        "noisyhead",
        {"prompts": 4096, "dim": 4, "mode": "rounds", "steps": 4, "sampling_rate": 0.25, "noise": "banded", "bands": 2},
    ),
    "expmech": ("expmech", {"n_users": 4096, "dim": 3, "rank": 1}),
}
CHUNKS = (1024, 256)


def _fake_cuda_module() -> Any:
    """This checkout's tests/fake_cuda.py (whatever fedpers is on the path), loaded once."""
    if "fedpers_fake_cuda" in sys.modules:
        return sys.modules["fedpers_fake_cuda"]
    spec = importlib.util.spec_from_file_location("fedpers_fake_cuda", ROOT / "tests" / "fake_cuda.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def per_round(name: str, values: dict[str, Any], chunk: int) -> list[tuple[int, int, int]]:
    """(syncs, launches, chunks) of every round of a ``--device cuda`` run of ``name`` on the local runtime
    (tests/fake_cuda.py's count; the fields the measured tree's algorithm lacks are left out)."""
    from fedpers.experiments import EXPERIMENTS

    known = EXPERIMENTS[name].config_type.__dataclass_fields__
    count: Any = _fake_cuda_module().per_round
    return [tuple(r) for r in count(name, {k: v for k, v in values.items() if k in known}, chunk)]


WHOLE_RUN = {"n_users": 8192, **SMALL, "dtype": "float32", "baselines": "none"}
"""The README's GPU command at a small size: AltMin, init + 2 rounds, evaluation, no baselines."""


def whole_run(chunk: int) -> tuple[int, int]:
    """(syncs, launches) of a whole ``fedpers run altmin --device cuda --baselines none`` (``execute``:
    set-up, rounds, per-round metrics, evaluation)."""
    from fedpers import config
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute

    exp = EXPERIMENTS["altmin"]
    with _fake_cuda_module().fake_cuda() as fc:
        cfg = config.build(exp.config_type, {**WHOLE_RUN, "chunk_size": chunk, "device": "cuda"})
        fc.traffic.reset()
        execute(exp, cfg, write=False, progress=False)
        return fc.traffic.syncs, getattr(fc.traffic, "launches", 0)


def measure() -> dict[str, dict[int, list[tuple[int, int, int]]]]:
    out: dict[str, Any] = {
        label: {c: per_round(name, values, c) for c in CHUNKS} for label, (name, values) in PATHS.items()
    }
    out["whole run"] = {c: [list(whole_run(c))] for c in CHUNKS}
    return out


def _against(tree: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, str(ROOT)])}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--json"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return {k: {int(c): v for c, v in per.items()} for k, per in json.loads(out.splitlines()[-1]).items()}


def _summary(rounds: list[list[int]]) -> tuple[str, str, str]:
    """(chunks per round, syncs per round, launches per chunk) as ranges over the rounds."""

    def span(values: list[float], fmt: str = "{:.0f}") -> str:
        lo, hi = min(values), max(values)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"

    return (
        span([r[2] for r in rounds]),
        span([r[0] for r in rounds]),
        span([r[1] / max(r[2], 1) for r in rounds]),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="", help="another tree (its fedpers) measured beside this one")
    p.add_argument("--json", action="store_true", help="print the raw counts as one JSON line")
    args = p.parse_args()
    now = measure()
    if args.json:
        print(json.dumps(now))
        return
    before = _against(args.against) if args.against else None
    print(
        f"chunk sizes {CHUNKS[0]} and {CHUNKS[1]}; per round over every round of the run (ranges where rounds differ)"
    )
    head = "| device path | chunk | chunks a round | host syncs a round | launches a chunk |"
    print(head)
    print("|---|---|---|---|---|")
    for label in PATHS:
        for c in CHUNKS:
            chunks, syncs, launches = _summary(now[label][c])
            if before is not None:
                _, old_syncs, old_launches = _summary(before[label][c])
                syncs, launches = f"{old_syncs} → {syncs}", f"{old_launches} → {launches}"
            print(f"| {label} | {c} | {chunks} | {syncs} | {launches} |")
    print(f"\nwhole run: fedpers run altmin {WHOLE_RUN} --device cuda (set-up, 3 rounds, metrics, evaluation)")
    for c in CHUNKS:
        syncs, launches = now["whole run"][c][0]
        if before is not None:
            old = before["whole run"][c][0]
            print(f"  chunk {c}: host syncs {old[0]} → {syncs}, launches {old[1]} → {launches}")
        else:
            print(f"  chunk {c}: host syncs {syncs}, launches {launches}")


if __name__ == "__main__":
    main()
