"""A sweep file, read and fully checked before any point runs (keys, every point's config, and
the metrics against the algorithm's declared result keys); the row a run gives in its table.

See :mod:`fedpers.sweeps.run` for the file's keys.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpers import config as config_lib
from fedpers.results import summaries


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    name: str
    algorithm: str
    x: str
    series: str
    metrics: tuple[str, ...]
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    series_values: dict[str, dict[str, Any]]
    repetitions: int = 1
    plot: dict[str, Any] = dataclasses.field(default_factory=dict)
    references: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """label → config overrides of a point run once (not per grid value), drawn as a horizontal line
    on every figure (e.g. the non-private run: ``{ epsilon = inf }``)."""
    columns: tuple[str, ...] = ()
    """Result keys recorded in the table beside the metrics, not plotted; blank where a run has none
    (e.g. ``modular_wraps``, which only a modular sum has)."""

    def identity(self) -> dict[str, Any]:
        """What makes two sweeps the same one (its directory's spec.json); ``references`` and
        ``columns`` only where given, so a sweep without them keeps its identity."""
        from fedpers.results.rundir import dumps

        fields = dataclasses.asdict(self)
        for key in ("references", "columns"):
            if not fields[key]:
                del fields[key]
        fields["plot"] = {k: v for k, v in fields["plot"].items() if k not in LABEL_KEYS}
        return json.loads(dumps(fields))

    def table(self, done: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Rows of the finished points (index → its rows), in grid order, each tagged with its
        series, x and other overrides."""
        points = self.points()
        rows = []
        for index in sorted(done):
            label, overrides = points[index]
            full = {**self.base, **overrides}
            tag = {self.series: label if label is not None else full.get(self.series), self.x: full.get(self.x)}
            fixed = {**tag, **{k: v for k, v in overrides.items() if k not in tag}}
            rows += [{**fixed, **{k: v for k, v in row.items() if k not in fixed}} for row in done[index]]
        return rows

    def points(self) -> list[tuple[str | None, dict[str, Any]]]:
        """(series label, config overrides) for every grid point, then one per reference (last, so
        adding references keeps the grid's point numbers)."""
        refs: list[tuple[str | None, dict[str, Any]]] = [(label, dict(o)) for label, o in self.references.items()]
        return self.grid_points() + refs

    def grid_points(self) -> list[tuple[str | None, dict[str, Any]]]:
        """The grid's points alone (the candidates a selection chooses among; references are not)."""
        keys = list(self.grid)
        combos = [dict(zip(keys, vals)) for vals in itertools.product(*(self.grid[k] for k in keys))] or [{}]
        if not self.series_values:
            return [(None, c) for c in combos]
        return [(label, {**c, **over}) for label, over in self.series_values.items() for c in combos]


TOP_KEYS = (
    "name",
    "algorithm",
    "x",
    "series",
    "metrics",
    "base",
    "grid",
    "series_values",
    "repetitions",
    "plot",
    "references",
    "columns",
)
LABEL_KEYS = ("xlabel", "ylabel", "title")
"""``[plot]`` keys that only name things on the figures (also set by ``fedpers sweep``'s flags): not
part of a sweep's identity, so a relabelled sweep reuses its points."""
PLOT_KEYS = ("xscale", "yscale", "baselines", "layout", *LABEL_KEYS)
SCALES = ("log", "linear")


def _check_structure(raw: dict[str, Any], fields: set[str], file: str) -> None:
    """Every key and value type of a sweep file, refused with the key's name before any point runs."""
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise ValueError(f"sweep: {file}: unknown key(s) {unknown}; allowed: {list(TOP_KEYS)}")
    for key in ("algorithm", "x", "series", "metrics"):
        if key not in raw:
            raise ValueError(f"sweep: {file} lacks required key {key!r}")
    for key in ("x", "series", "name"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"sweep: {key} must be a string; got {raw[key]!r}")
    metrics = raw["metrics"]
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise ValueError(
            f'sweep: metrics must be a non-empty list of result keys, e.g. ["excess_risk"]; got {metrics!r}'
        )
    for key in ("base", "grid", "series_values", "plot", "references"):
        if key in raw and not isinstance(raw[key], dict):
            raise ValueError(f"sweep: [{key}] must be a table; got {raw[key]!r}")
    for key, values in raw.get("grid", {}).items():
        if key not in fields:
            raise ValueError(f"sweep: grid key {key!r} is not a config field; fields: {', '.join(sorted(fields))}")
        if isinstance(values, list) and not values:
            raise ValueError(f"sweep: grid.{key} is an empty list; give at least one value")
        if isinstance(values, list):
            repeated = [v for i, v in enumerate(values) if any(v == w for w in values[:i])]
            if repeated:
                raise ValueError(
                    f"sweep: grid.{key} lists {repeated[0]!r} more than once (each value would run again as its own "
                    "point); give each value once (repeat runs with --repetitions)"
                )
    for key in raw.get("base", {}):
        if key not in fields:
            raise ValueError(f"sweep: base key {key!r} is not a config field; fields: {', '.join(sorted(fields))}")
    both = sorted(set(raw.get("base", {})) & set(raw.get("grid", {})))
    if both:
        raise ValueError(
            f"sweep: {both} in both [base] and [grid] (the grid's values would replace the base's); keep one"
        )
    for section in ("series_values", "references"):
        for label, over in raw.get(section, {}).items():
            if not isinstance(over, dict):
                raise ValueError(f"sweep: {section}.{label} must be a table of config overrides; got {over!r}")
    clash = sorted(set(raw.get("references", {})) & set(raw.get("series_values", {})))
    if clash:
        raise ValueError(f"sweep: references {clash} reuse series labels; give each line its own label")
    columns = raw.get("columns", [])
    if not isinstance(columns, list) or not all(isinstance(c, str) and c for c in columns):
        raise ValueError(f'sweep: columns must be a list of result keys, e.g. ["modular_wraps"]; got {columns!r}')
    if raw["x"] not in fields:
        raise ValueError(f"sweep: x = {raw['x']!r} is not a config field; fields: {', '.join(sorted(fields))}")
    if not raw.get("series_values") and raw["series"] not in fields:
        raise ValueError(
            f"sweep: series = {raw['series']!r} is not a config field (or give [series_values]); fields: {', '.join(sorted(fields))}"
        )
    if not raw.get("series_values") and raw["series"] == raw["x"]:
        raise ValueError(
            f"sweep: x and series are both {raw['x']!r}; a figure's lines need another field than its axis"
        )
    reps = raw.get("repetitions", 1)
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"sweep: repetitions must be an integer >= 1; got {reps!r}")
    plot = raw.get("plot", {})
    unknown = sorted(set(plot) - set(PLOT_KEYS))
    if unknown:
        raise ValueError(f"sweep: [plot] unknown key(s) {unknown}; allowed: {list(PLOT_KEYS)}")
    for key in ("xscale", "yscale"):
        if key in plot and plot[key] not in SCALES:
            raise ValueError(f"sweep: plot.{key} must be one of {list(SCALES)}; got {plot[key]!r}")
    for key in LABEL_KEYS:
        if key in plot and not (isinstance(plot[key], str) and plot[key].strip()):
            raise ValueError(f"sweep: plot.{key} must be a non-empty string; got {plot[key]!r}")


def _runtime_options() -> Any:
    from fedpers.configs.runtime import RuntimeOptions

    return RuntimeOptions


def runtime_fields() -> set[str]:
    """Keys a sweep may set that are runtime options (``dp_model``, ``bits``, ``nodes``, ...), not
    the algorithm's config; ``runtime`` itself stays ``local`` unless a point names it."""
    return {f.name for f in dataclasses.fields(_runtime_options())}


def split_options(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the algorithm's config values, the runtime options) of one point."""
    names = runtime_fields()
    return {k: v for k, v in values.items() if k not in names}, {k: v for k, v in values.items() if k in names}


def load_spec(
    path: str | Path, repetitions: int | None = None, labels: Mapping[str, str | None] | None = None
) -> SweepSpec:
    """The sweep file's spec, every key checked; ``labels``: ``[plot]`` label keys (:data:`LABEL_KEYS`)
    given on the command line, over the file's."""
    from fedpers.experiments import ALGORITHMS, EXPERIMENTS

    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"sweep: cannot read {path}: {e}") from None
    given = {k: v for k, v in (labels or {}).items() if v is not None}
    if given and isinstance(raw.get("plot", {}), dict):
        raw["plot"] = {**raw.get("plot", {}), **given}
    if raw.get("algorithm") not in ALGORITHMS:
        raise ValueError(f"sweep: algorithm must be one of {sorted(ALGORITHMS)}; got {raw.get('algorithm')!r}")
    fields = {f.name for f in dataclasses.fields(EXPERIMENTS[raw["algorithm"]].config_type)}
    _check_structure(raw, fields | runtime_fields(), path.name)
    grid = {k: (v if isinstance(v, list) else [v]) for k, v in raw.get("grid", {}).items()}
    if repetitions is not None and (
        isinstance(repetitions, bool) or not isinstance(repetitions, int) or repetitions < 1
    ):
        raise ValueError(f"repetitions must be an integer >= 1; got {repetitions!r}")
    reps = int(repetitions if repetitions is not None else raw.get("repetitions", 1))
    spec = SweepSpec(
        name=str(raw.get("name", path.stem)),
        algorithm=raw["algorithm"],
        x=raw["x"],
        series=raw["series"],
        metrics=tuple(raw["metrics"]),
        base=dict(raw.get("base", {})),
        grid=grid,
        series_values=dict(raw.get("series_values", {})),
        repetitions=reps,
        plot=dict(raw.get("plot", {})),
        references={str(k): dict(v) for k, v in raw.get("references", {}).items()},
        columns=tuple(raw.get("columns", [])),
    )
    exp = EXPERIMENTS[spec.algorithm]
    for _, over in spec.points():  # validate every point before any work
        values, options = split_options({**spec.base, **over})
        config_lib.build(exp.config_type, values)
        config_lib.build(_runtime_options(), options)
    check_declared_metrics(spec, exp.result_keys, exp.baseline_names)
    return spec


RUN_KEYS = ("epsilon", "delta", "noise_multiplier", "seconds")
"""Top-level result keys every run has beside its algorithm's metrics (runner.execute)."""

SOME_RUNS_KEYS = ("modular_wraps", "suspected_wraps")
"""Top-level result keys only some runs have (a modular sum's wrap counts, totalled over its rounds by
runner.result_of): allowed as ``columns``, blank where a run has none."""


def check_declared_metrics(spec: SweepSpec, result_keys: tuple[str, ...], baseline_names: tuple[str, ...]) -> None:
    """Each metric must be one the algorithm declares (``Experiment.result_keys``), a run key
    (ε, δ, noise, seconds), ``privacy.KEY``, or ``baselines.NAME.METRIC`` with a declared
    baseline and metric; refused naming what is available, before any point runs."""

    def known(metric: str) -> bool:
        parts = metric.split(".")
        if len(parts) == 1:
            return metric in result_keys or metric in RUN_KEYS
        if parts[0] == "privacy":
            return len(parts) == 2
        return len(parts) == 3 and parts[0] == "baselines" and parts[1] in baseline_names and parts[2] in result_keys

    unknown = [c for c in spec.columns if not (known(c) or c in SOME_RUNS_KEYS)]
    if unknown:
        raise ValueError(
            f"sweep: column(s) {unknown} not in {spec.algorithm}'s result; available: "
            f"{', '.join(sorted({*result_keys, *RUN_KEYS, *SOME_RUNS_KEYS}))}"
        )
    missing = [m for m in spec.metrics if not known(m)]
    if missing:
        raise ValueError(
            f"sweep: metric(s) {missing} not in {spec.algorithm}'s result; available: {', '.join(sorted({*result_keys, *RUN_KEYS}))}"
            + (f"; baselines.NAME.METRIC with NAME in {', '.join(baseline_names)}" if baseline_names else "")
        )


def _lookup(result: dict[str, Any], key: str, default: Any = None) -> Any:
    """``result["a"]["b"]`` for key ``a.b``; ``default`` where the path does not exist."""
    value: Any = result
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


_number = summaries.number


def result_row(spec: SweepSpec, result: dict[str, Any]) -> dict[str, Any]:
    """A run's row of the sweep table: its time, the metrics asked for, the ε spent, baselines."""
    row = {"seconds": result["seconds"]}
    for key in spec.metrics:
        row[key] = _number(_lookup(result, key))
    row["epsilon_spent"] = _number(_lookup(result, "epsilon"))
    for key in spec.columns:  # blank (None) where this run has no such key
        value = _lookup(result, key)
        row[key] = None if value is None else _number(value)
    for b in spec.plot.get("baselines", []):
        for m in spec.metrics:
            if "." not in m:
                row[f"baselines.{b}.{m}"] = _number(_lookup(result, f"baselines.{b}.{m}"))
    return row


def check_metrics(spec: SweepSpec, result: dict[str, Any]) -> None:
    """A declared metric that this point's result does not have (it depends on the config or the
    data, e.g. no true U* in a data file) stops the sweep at that point, naming what it has."""
    missing = [key for key in spec.metrics if not _has(result, key)]
    if missing:
        numeric = sorted(
            k
            for k, v in result.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("_")
        )
        baselines = sorted(result.get("baselines", {})) if isinstance(result.get("baselines"), dict) else []
        raise ValueError(
            f"sweep: metric(s) {missing} not in {spec.algorithm}'s result; available: {', '.join(numeric)}"
            + (f"; baselines.NAME.METRIC with NAME in {', '.join(baselines)}" if baselines else "")
        )


_MISSING = object()


def _has(result: dict[str, Any], key: str) -> bool:
    return _lookup(result, key, _MISSING) is not _MISSING
