"""Run directories: resolved config, per-round metrics, ledger, final result, plots.

Every file is written whole (temporary file, then rename); per-round lines are appended
and flushed as rounds finish, so a run that fails keeps what it had and says why in
``error.json``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedpers.results.run_result import RunResult


def _clean(value: Any) -> Any:
    """JSON-safe: inf/nan as strings, numpy/torch scalars as floats."""
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, Path):
        return str(value)
    return value


def dumps(value: Any, indent: int | None = 1) -> str:
    return json.dumps(_clean(value), indent=indent, ensure_ascii=False)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # nothing half-written is left beside ``path``
        tmp.unlink(missing_ok=True)
        raise


def default_run_dir(algorithm: str, seed: int) -> Path:
    """runs/<algorithm>-<time>-s<seed>, with -2, -3, … if runs started in the same second took it.

    The directory is created here (an atomic mkdir), so concurrent starts never share one.
    """
    base = Path("runs") / f"{algorithm}-{time.strftime('%Y%m%d-%H%M%S')}-s{seed}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 10_000):
        path = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ValueError(f"out: no free run directory next to {base}")


def _write_npz(path: Path, arrays: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.stem}.tmp.npz")
    arrays = {k: (v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)) for k, v in arrays.items()}
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


EVALUATOR_STATE = "evaluator_state.npz"
"""What the evaluator kept across rounds (:meth:`RunDirectory.keep_evaluator_state`)."""

LEDGER_LOG = "ledger.jsonl"
"""One line per noisy release, appended (and flushed to disk) the moment it is drawn."""


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines of an append-only log; a last line cut short by a kill is not a record."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().split("\n"):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def lock_directory(path: Path) -> Any:
    """Hold ``path/.lock`` exclusively while a run or sweep writes there (the OS drops it when
    the process dies), so a second one into a directory still in use is refused, not interleaved."""
    import fcntl

    if not path.is_dir():
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file in the way, a read-only parent
            why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
            raise ValueError(f"out: cannot create the directory {path}: {why}; choose another --out") from None
    handle = open(path / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip()
        handle.close()
        raise ValueError(
            f"{path} is in use by another running process{f' (pid {owner})' if owner else ''}; wait for it or stop it first"
        ) from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def check_free(path: str | Path) -> None:
    """Refuse a run directory that already holds a run or a sweep (naming it): a new run never mixes its
    files with another's. It reads only the folder's names, so the command line answers it before the
    run's libraries are imported."""
    path = Path(path)
    if (path / "config.json").exists():
        raise ValueError(f"out: {path} already holds a run; choose another --out (or `fedpers resume {path}`)")
    if (path / "spec.json").exists():  # a run's files would replace the sweep's (provenance, figures)
        raise ValueError(f"out: {path} holds a sweep (spec.json), not a run; choose another --out")


class RunDirectory:
    """One run's output folder. Refuses a folder that already holds a run, unless resuming it."""

    def __init__(self, path: str | Path, *, resume: bool = False) -> None:
        self.path = Path(path)
        self._lock = lock_directory(self.path) if resume else None
        if resume:
            if not (self.path / "config.json").is_file():
                raise ValueError(f"resume: {self.path} is not a fedpers run directory (no config.json)")
            if (self.path / "result.json").is_file():
                raise ValueError(f"resume: {self.path} holds a completed run; nothing to resume")
            releases = _read_lines(self.path / LEDGER_LOG)
            write_atomic(
                self.path / LEDGER_LOG, "".join(dumps(r, indent=None) + "\n" for r in releases)
            )  # drop a cut-short line
            for stale in ("ledger.json", "error.json"):
                self.remove(stale)
        else:
            check_free(self.path)
        self._created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file in the way, a read-only parent: refused before any release
            why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
            raise ValueError(f"out: cannot create the run directory {self.path}: {why}; choose another --out") from None
        self._lock = self._lock or lock_directory(self.path)
        self._rounds = open(self.path / "rounds.jsonl", "a" if resume else "w")
        self._releases = open(self.path / LEDGER_LOG, "a" if resume else "w")

    def recorded_releases(self) -> list[dict[str, Any]]:
        return _read_lines(self.path / LEDGER_LOG)

    def recorded_rounds(self) -> list[dict[str, Any]]:
        return _read_lines(self.path / "rounds.jsonl")

    def rewrite_rounds(self, rounds: Sequence[Mapping[str, Any]]) -> None:
        """Replace the round log (a resumed run keeps only the checkpointed rounds)."""
        self._rounds.close()
        write_atomic(self.path / "rounds.jsonl", "".join(dumps(r, indent=None) + "\n" for r in rounds))
        self._rounds = open(self.path / "rounds.jsonl", "a")

    def remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def append_release(self, release: Any) -> None:
        """Record one release durably before anything else happens (a killed run keeps it)."""
        self._releases.write(dumps(release.to_dict(), indent=None) + "\n")
        self._releases.flush()
        os.fsync(self._releases.fileno())

    def write_json(self, name: str, value: Any) -> None:
        write_atomic(self.path / name, dumps(value) + "\n")

    def start(self, saved: Mapping[str, Any], constants: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """A new run: its config (as given), the derived constants and where it ran."""
        self.write_json("config.json", saved)
        self.write_json("constants.json", constants)
        self.write_json("provenance.json", record)

    def keep_evaluator_state(self, arrays: Mapping[str, Any]) -> None:
        """What the evaluator keeps across rounds (published values only, e.g. round 0's U),
        rewritten when it changes, so a resumed run's result has the same baselines."""
        if arrays and {k: id(v) for k, v in arrays.items()} != getattr(self, "_evaluator_ids", None):
            _write_npz(self.path / EVALUATOR_STATE, arrays)
            self._evaluator_ids = {k: id(v) for k, v in arrays.items()}

    def evaluator_state(self, device: str = "cpu") -> dict[str, Any]:
        import torch

        path = self.path / EVALUATOR_STATE
        if not path.is_file():
            return {}
        with np.load(path) as kept:
            return {k: torch.from_numpy(kept[k]).to(device) for k in kept.files}

    def keep_private_result(self, ledger: Any, state: Any) -> None:
        """The ledger and the final state's tensors (final_state.npz), written before any evaluation can fail.
        A state's other entries (flags, notes such as DPAttention's ``dp_claimed``) are not arrays: the run's
        result carries what it reports of them. A simulation's caller reads its state back from this file."""
        import torch

        self.write_json("ledger.json", [r.to_dict() for r in ledger])
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if isinstance(state, dict) else {}
        if tensors:
            self.write_arrays("final_state.npz", tensors)

    def fail(self, ledger: Any, error: BaseException, rounds_completed: int) -> None:
        """A run that failed keeps every release it made and says why (error.json). One that
        failed before its first release has nothing to keep: the directory it created is removed
        whole (nothing half-written blocks reusing ``--out``)."""
        import traceback

        ledger.settle()
        if self._created and not len(ledger) and not _read_lines(self.path / LEDGER_LOG):
            self.close()
            shutil.rmtree(self.path, ignore_errors=True)
            return
        self.write_json("ledger.json", [r.to_dict() for r in ledger])
        self.write_json(
            "error.json",
            {
                "status": "failed",
                "error": f"{type(error).__name__}: {error}",
                "rounds_completed": rounds_completed,
                "traceback": traceback.format_exc(),
            },
        )
        self.close()

    def finish(self, result: RunResult, rounds: list[dict[str, Any]], experiment: Any, cfg: Any) -> RunResult:
        """The completed run: per-round plots, result.json, and provenance's finishing time;
        returns the result with its plots and run directory."""
        from fedpers.results.plots import privacy_title

        provenance = json.loads((self.path / "provenance.json").read_text())
        self.write_json("provenance.json", {**provenance, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        self.remove("error.json")
        privacy = result.privacy.to_dict() if result.privacy is not None else {}
        plots = self.plot_rounds(
            rounds,
            experiment.plot_keys(),
            privacy_title(experiment.name, {"delta": getattr(cfg, "delta", None), **privacy}),
            round_axis=experiment.round_axis,
            baselines=result.baselines,
        )
        result = dataclasses.replace(result, plots=tuple(plots), run_dir=str(self.path))
        self.write_json("result.json", result.to_dict())
        self.close()
        return result

    def write_arrays(self, name: str, arrays: Mapping[str, Any]) -> None:
        """Tensors/arrays as one ``.npz`` (written whole, then renamed)."""
        _write_npz(self.path / name, arrays)

    def append_round(self, record: Mapping[str, Any]) -> None:
        self._rounds.write(dumps(record, indent=None) + "\n")
        self._rounds.flush()

    def close(self) -> None:
        self._rounds.close()
        self._releases.close()
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    def plot_rounds(
        self,
        rounds: Sequence[Mapping[str, Any]],
        keys: Iterable[str],
        title: str,
        *,
        round_axis: str = "round",
        baselines: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[str]:
        """One PNG per key: the metric against the round, baselines as reference lines (drawn by
        the process's started :class:`~fedpers.results.plots.PlotWorker` if there is one, else here)."""
        from fedpers.results.plots import plot_run, take_worker

        worker = take_worker()
        if worker is not None:
            written = worker.plot_run(self.path, rounds, keys, title=title, round_axis=round_axis, baselines=baselines)
            if written is not None:
                return [str(name) for name in written]
        return plot_run(self.path, rounds, keys, title=title, round_axis=round_axis, baselines=baselines)


def read_run(path: str | Path) -> dict[str, Any]:
    """Load a finished (or failed) run directory back."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a fedpers run directory (no config.json)")
    out: dict[str, Any] = {"config": json.loads((path / "config.json").read_text())}
    for name in ("result.json", "error.json", "constants.json"):
        if (path / name).is_file():
            out[name.removesuffix(".json")] = json.loads((path / name).read_text())
    out["rounds"] = _read_lines(path / "rounds.jsonl")
    if (path / "ledger.json").is_file():
        out["ledger_text"] = (path / "ledger.json").read_text()
    else:  # killed before the end: the per-release log is the record
        out["ledger_text"] = json.dumps(_read_lines(path / LEDGER_LOG))
    out["complete"] = "result" in out
    return out


def write_table(rows: list[dict[str, Any]], path: Path) -> None:
    """``path`` (.csv) and the same table as Parquet beside it, each written whole then renamed."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    write_parquet(rows, columns, path.with_suffix(".parquet"))


def write_parquet(rows: list[dict[str, Any]], columns: list[str], path: Path) -> None:
    """Numeric columns as float64 (None/NaN where a row lacks the value), any other as strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {}
    for c in columns:
        values = [row.get(c) for row in rows]
        if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            arrays[c] = pa.array([math.nan if v is None else float(v) for v in values], pa.float64())
        else:
            arrays[c] = pa.array([None if v is None else str(v) for v in values], pa.string())
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table(arrays), tmp)
    tmp.replace(path)


class SweepDirectory:
    """A sweep's output directory, held under an exclusive lock while open: ``spec.json`` (the
    sweep's identity: another sweep is refused), ``provenance.json``, and per finished point
    ``points/NNNNN.json`` (its rows) with each repetition's run directory ``points/NNNNN-rR/``.

    A point counts as done once its record is written, so a killed sweep reruns only the points
    without one. A directory this sweep created is removed again if the sweep fails before its
    first point is recorded: a failed start leaves nothing behind.
    """

    def __init__(self, path: Path, identity: dict[str, Any], launch: dict[str, Any]) -> None:
        self.path = path
        if (path / "spec.json").exists():
            if json.loads((path / "spec.json").read_text()) != identity:
                raise ValueError(f"out: {path} holds a different sweep (its spec.json differs); choose another --out")
        elif (path / "table.csv").exists():
            raise ValueError(f"out: {path} already holds a sweep; choose another --out")
        elif (path / "config.json").exists():
            raise ValueError(f"out: {path} holds a run (config.json), not a sweep; choose another --out")
        self._created = not path.exists()
        self._lock = lock_directory(path)  # a second sweep into the same directory is refused while this one runs
        self._recorded = 0
        (path / "points").mkdir(exist_ok=True)
        write_atomic(path / "spec.json", dumps(identity) + "\n")
        from fedpers.results.provenance import provenance

        write_atomic(path / "provenance.json", dumps({**provenance(), **launch}) + "\n")

    def __enter__(self) -> SweepDirectory:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        self._lock.close()
        if error is not None and self._created and not self._recorded:
            shutil.rmtree(self.path, ignore_errors=True)

    def done(self) -> dict[int, list[dict[str, Any]]]:
        """Point index → its rows, for every point recorded (by this sweep or before an interruption)."""
        out = {}
        for record in sorted((self.path / "points").glob("[0-9][0-9][0-9][0-9][0-9].json")):
            out[int(record.stem)] = json.loads(record.read_text())["rows"]
        return out

    def record_point(
        self,
        index: int,
        label: Any,
        overrides: dict[str, Any],
        rows: list[dict[str, Any]],
        runs: dict[str, dict[str, bytes]],
    ) -> None:
        """Each repetition's run directory (written whole then renamed), then the point's record."""
        points = self.path / "points"
        for name, files in runs.items():
            final = points / f"{index:05d}-{name}"
            tmp = points / f".{final.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for fname, data in files.items():
                (tmp / fname).write_bytes(data)
            shutil.rmtree(final, ignore_errors=True)  # a leftover of a killed sweep: replaced whole
            os.replace(tmp, final)
        record = {
            "label": label,
            "overrides": overrides,
            "rows": rows,
            "runs": sorted(f"{index:05d}-{n}" for n in runs),
        }
        write_atomic(points / f"{index:05d}.json", dumps(record) + "\n")
        self._recorded += 1
