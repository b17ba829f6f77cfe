"""A sweep's shared baselines: computed once per data set and seed, reused by every point that shares them.

The non-private baselines of a run (AltMin's reference fit, local-only, oracle, clipped-no-noise)
depend on its data, its seed and their own parameters, never on ε, δ or the noise
(:meth:`~fedpers.experiments.base.Experiment.shared_baselines`). A grid over ε (or δ, the accountant,
the calibration) would recompute them at every point; here the first point of each
:meth:`~fedpers.experiments.base.Experiment.baseline_key` computes them, its rows are kept in the
sweep directory (``baselines/DIGEST.json``: the key and the rows), and every later point with that
key is handed them (``execute(..., reuse=...)``): its run computes only the private fit and the
baselines that depend on its privacy (the private initialisation). A key is every config field but
the experiment's :attr:`~fedpers.experiments.base.Experiment.privacy_fields` (and a data file's size and
modification time), so a changed data field, seed or baseline parameter is another key and is
computed again; a resumed sweep reads the kept rows back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpers.results.rundir import dumps, write_atomic

Rows = dict[str, dict[str, Any]]
"""Baseline name → the row a run reports under ``baselines``."""


class SharedBaselines:
    """The shared baselines of one sweep (``spec``) kept under ``path``/baselines: which key each
    repetition of a point has, which keys are known, and which a point in flight is computing."""

    def __init__(self, spec: Any, path: Path) -> None:
        self.spec, self.dir = spec, path / "baselines"
        self.rows: dict[str, Rows] = {}
        self.claimed: dict[str, int] = {}
        """Digest → the point index computing it now (a point that needs it waits, or computes it too)."""
        for record in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            kept = json.loads(record.read_text())
            self.rows[record.stem] = _numbers(kept["rows"])
        self._keys: dict[str, dict[int, tuple[str, dict[str, Any]]]] = {}

    def keys(self, overrides: Mapping[str, Any]) -> dict[int, tuple[str, dict[str, Any]]]:
        """Repetition → (digest, key) of the point's shared baselines (empty: it shares none)."""
        tag = json.dumps(overrides, sort_keys=True, default=str)
        if tag not in self._keys:
            self._keys[tag] = _keys(self.spec, overrides)
        return self._keys[tag]

    def known(self, overrides: Mapping[str, Any]) -> dict[int, Rows]:
        """Repetition → the kept rows of its key, for the repetitions whose key is known."""
        return {r: self.rows[digest] for r, (digest, _) in self.keys(overrides).items() if digest in self.rows}

    def blocked(self, index: int, overrides: Mapping[str, Any]) -> bool:
        """Whether a key the point needs is being computed by another point in flight."""
        return any(
            digest not in self.rows and self.claimed.get(digest, index) != index
            for digest, _ in self.keys(overrides).values()
        )

    def claim(self, index: int, overrides: Mapping[str, Any]) -> dict[int, Rows]:
        """The point starts: it computes the keys nobody knows (claimed for it); returns what it reuses."""
        for digest, _ in self.keys(overrides).values():
            if digest not in self.rows:
                self.claimed.setdefault(digest, index)
        return self.known(overrides)

    def record(self, index: int, overrides: Mapping[str, Any], runs: Mapping[str, Mapping[str, bytes]]) -> None:
        """Keep the shared rows the point computed (from each repetition's result.json), release its claims."""
        for r, (digest, key) in self.keys(overrides).items():
            if self.claimed.get(digest) == index:
                del self.claimed[digest]
            files = runs.get(f"r{r}", {})
            if digest in self.rows or "result.json" not in files:
                continue
            rows = _shared_rows(self.spec, overrides, r, _numbers(json.loads(files["result.json"])))
            if rows is None:
                continue
            self.dir.mkdir(exist_ok=True)
            write_atomic(
                self.dir / f"{digest}.json",
                dumps({"key": key, "rows": rows, "computed_by": f"{index:05d}-r{r}"}) + "\n",
            )
            self.rows[digest] = rows


def _configs(spec: Any, overrides: Mapping[str, Any]) -> tuple[Any, list[Any], Any] | None:
    """(experiment, each repetition's config, runtime options) of a point, or None where its runs
    evaluate nothing the server could share (vectorised Monte-Carlo points, no server data)."""
    from fedpers import config as config_lib
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import EXPERIMENTS
    from fedpers.sweeps.spec import split_options

    exp = EXPERIMENTS[spec.algorithm]
    values, option_values = split_options({**spec.base, **overrides})
    if hasattr(exp, "sweep_point") and not option_values:
        return None
    options = config_lib.build(RuntimeOptions, option_values)
    if not options.server_data:
        return None
    cfg = config_lib.build(exp.config_type, values)
    seeded = [
        dataclasses.replace(cfg, seed=cfg.seed + r) if hasattr(cfg, "seed") else cfg for r in range(spec.repetitions)
    ]
    return exp, seeded, options


def _keys(spec: Any, overrides: Mapping[str, Any]) -> dict[int, tuple[str, dict[str, Any]]]:
    made = _configs(spec, overrides)
    if made is None:
        return {}
    exp, seeded, _ = made
    out = {}
    for r, cfg in enumerate(seeded):
        key = exp.baseline_key(cfg)
        if key is not None:
            digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
            out[r] = (digest, key)
    return out


def _shared_rows(spec: Any, overrides: Mapping[str, Any], repetition: int, result: Mapping[str, Any]) -> Rows | None:
    """The shared baselines' rows of a finished run's result (None: it has not all of them)."""
    made = _configs(spec, overrides)
    if made is None:
        return None
    exp, seeded, _ = made
    return exp.shared_rows(seeded[repetition], result)


def _numbers(value: Any) -> Any:
    """A record read back from JSON with its non-finite numbers as floats again (run directories write
    them as the strings "inf", "-inf", "nan": a reused row must hold what the run computed)."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return value
