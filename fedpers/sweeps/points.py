"""Running a sweep's points: one at a time here, or concurrently on a local Ray or a Ray cluster.

A point runs every repetition as a normal run into a private temporary directory and
returns its rows together with the bytes of each repetition's run directory (config,
ledger, rounds, result, final state, provenance). The sweep's own process writes them under
``points/`` — so a point is a full run directory whether it ran here or on another machine
of a cluster, and a point counts as done only once its record is written (a killed sweep
reruns only the points without one). The result of a point does not depend on where it ran
(same seed, same code; a different thread count may change the last bits of a BLAS sum).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedpers.results.rundir import SweepDirectory
    from fedpers.sweeps.spec import SweepSpec

Task = tuple[int, dict[str, Any]]
"""(point index, config overrides)."""

PointResult = tuple[list[dict[str, Any]], dict[str, dict[str, bytes]]]
"""(rows, run directory name -> file name -> bytes)."""

Executor = Callable[[Any, Sequence[Task]], Iterator[tuple[int, PointResult]]]
"""Runs tasks of a sweep spec, yielding each point's result as it finishes."""


def run_point_task(spec: Any, overrides: dict[str, Any], threads: int = 0) -> PointResult:
    """All repetitions of one grid point (``threads`` > 0: torch's intra-op threads for this worker). A
    repetition refused before any release on its declared values
    (:class:`~fedpers.privacy.refusal.RefusedBeforeRelease`, e.g. too few bits for n units) is a row
    ``{"repetition": r, "refused": why}`` without a run directory; any other error stops the sweep."""
    import torch

    from fedpers import config as config_lib
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute
    from fedpers.sweeps.spec import check_metrics, result_row

    if threads > 0:
        torch.set_num_threads(threads)
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.sweeps.spec import split_options

    exp = EXPERIMENTS[spec.algorithm]
    values, option_values = split_options({**spec.base, **overrides})
    cfg = config_lib.build(exp.config_type, values)
    options = config_lib.build(RuntimeOptions, option_values)
    if (
        hasattr(exp, "sweep_point") and not option_values
    ):  # vectorised Monte Carlo over repetitions: no per-repetition run
        start = time.perf_counter()
        rows = exp.sweep_point(cfg, spec.repetitions)
        per = (time.perf_counter() - start) / max(len(rows), 1)
        check_metrics(spec, rows[0] if rows else {})
        return [{"repetition": r, "seconds": per, **row} for r, row in enumerate(rows)], {}
    from fedpers.privacy.refusal import RefusedBeforeRelease

    rows, runs = [], {}
    for r in range(spec.repetitions):
        seeded = dataclasses.replace(cfg, seed=cfg.seed + r) if hasattr(cfg, "seed") else cfg
        with tempfile.TemporaryDirectory(prefix="fedpers-point-") as tmp:
            try:
                result = execute(exp, seeded, options, out=Path(tmp) / "run", progress=False)
            except RefusedBeforeRelease as e:  # decided on declared values before any release: a result
                rows.append({"repetition": r, "refused": str(e)})
                continue
            check_metrics(spec, result)
            runs[f"r{r}"] = {
                p.name: p.read_bytes()
                for p in (Path(tmp) / "run").iterdir()
                if p.is_file() and not p.name.startswith(".")
            }
        rows.append({"repetition": r, **result_row(spec, result)})
    return rows, runs


def run_points(spec: SweepSpec, sweep_dir: SweepDirectory, run: Executor, progress: bool = True) -> tuple[int, int]:
    """Run every point ``sweep_dir`` has no record of, recording each (and the table so far) as
    it finishes; returns (points run, points reused)."""
    from tqdm.auto import tqdm

    from fedpers.results.rundir import write_table

    points = spec.points()
    done = sweep_dir.done()
    reused = len(done)
    tasks = [(index, overrides) for index, (_, overrides) in enumerate(points) if index not in done]
    bar = tqdm(total=len(points), initial=reused, desc=f"sweep {spec.name}", unit="point", disable=not progress)
    for index, (point_rows, runs) in run(spec, tasks):
        label, overrides = points[index]
        sweep_dir.record_point(index, label, overrides, point_rows, runs)
        done[index] = point_rows
        write_table(spec.table(done), sweep_dir.path / "table.csv")
        bar.update(1)
    bar.close()
    return len(tasks), reused


def serial(spec: Any, tasks: Sequence[Task]) -> Iterator[tuple[int, PointResult]]:
    for index, overrides in tasks:
        yield index, run_point_task(spec, overrides)


def on_ray(spec: Any, tasks: Sequence[Task], workers: int, address: str = "") -> Iterator[tuple[int, PointResult]]:
    """At most ``workers`` points in flight on a new local Ray (``address`` empty) or a cluster."""
    import ray

    import fedpers

    checkout = str(Path(fedpers.__file__).resolve().parents[1])  # Ray workers import this fedpers
    local = not address
    threads = max(1, (os.cpu_count() or 1) // workers) if local else 1
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local" if local else address,
        num_cpus=workers if local else None,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(run_point_task)
        spec_ref = ray.put(spec)
        pending = list(tasks)
        running: dict[Any, int] = {}
        while pending or running:
            while pending and len(running) < workers:
                index, overrides = pending.pop(0)
                running[remote.remote(spec_ref, overrides, threads)] = index
            done, _ = ray.wait(list(running), num_returns=1)
            index = running.pop(done[0])
            try:
                yield index, ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                cause = e.as_instanceof_cause()
                raise (
                    cause if isinstance(cause, ValueError) else RuntimeError(f"sweep point {index} failed on Ray: {e}")
                ) from None
    finally:
        ray.shutdown()


def executor(workers: int, address: str) -> Executor:
    if workers < 1:
        raise ValueError(f"workers must be an integer >= 1; got {workers}")
    if workers == 1 and not address:
        return serial
    return lambda spec, tasks: on_ray(spec, tasks, workers, address)
