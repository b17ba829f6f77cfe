"""`--track tensorboard|mlflow`: a finished run or sweep, logged where researchers already look.

Everything is read back from the run directory the runner wrote (config.json, rounds.jsonl,
the ledger, result.json, the PNGs), so tracking never touches a run's computation and the
logs hold exactly what the run recorded:

- the configuration (TensorBoard: a text panel; MLflow: parameters, flattened);
- per-round metrics at step = round;
- ``privacy/epsilon_spent`` after each release (step = release number), from the ledger
  with the run's accountant — the ε a reader would get had the run stopped there;
- the final metrics (``final/…``) and every baseline's (``baseline/NAME/…``);
- the run's figures (TensorBoard: images; MLflow: artifacts) and result.json.

A sweep logs one run per grid point (its repetitions' metrics at step = repetition), grouped:
TensorBoard one sub-directory per point under ``tensorboard/``, MLflow one experiment named
after the sweep with a ``sweep`` tag on each run. The trackers are optional extras
(``pip install 'fedpers[track]'``): TensorBoard's writer is torch's ``SummaryWriter``, MLflow
its own client; nothing here writes their formats by hand.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedpers.results.rundir import read_run


class Tracker(str, enum.Enum):
    TENSORBOARD = "tensorboard"
    MLFLOW = "mlflow"


EXTRA = "pip install 'fedpers[track]'"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"runtime": {"nodes": 8}} -> {"runtime.nodes": 8}: one parameter per config field."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def epsilon_after_each_release(run: Mapping[str, Any], result: Mapping[str, Any]) -> list[float]:
    """ε of the releases made so far, after each one (the run's accountant and δ)."""
    from fedpers.privacy import ACCOUNTANTS, Accountant, Ledger, ledger_epsilon

    cfg = run["config"]
    ledger = Ledger.from_json(run["ledger_text"])
    releases = list(ledger)
    delta = float(cfg.get("delta") or result.get("delta") or 1e-5)
    if delta <= 0:  # a pure ε-DP run (expmech): δ is 0, any δ gives the same ε
        delta = 1e-5
    name = str(result.get("privacy", {}).get("accountant") or cfg.get("accountant") or "pld")
    accountant = (
        name if name in ACCOUNTANTS else Accountant.PLD
    )  # a registered one; a description ("pure ε-DP composition"): pld
    out = []
    for i in range(1, len(releases) + 1):
        out.append(float(ledger_epsilon(Ledger(releases[:i]), delta, accountant)))
    return out


def final_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """``final/KEY`` for the private run's figures and ``baseline/NAME/KEY`` for each baseline's
    (:func:`fedpers.commands.summary.tracker_values`); none for a run that did not finish."""
    from fedpers.commands.summary import tracker_values
    from fedpers.results.run_result import RunResult

    return tracker_values(RunResult.from_dict(result)) if result else {}


def round_series(rounds: Iterable[Mapping[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    return [
        (int(r.get("round", i)), {f"round/{k}": float(v) for k, v in r.items() if _number(v) and k != "round"})
        for i, r in enumerate(rounds)
    ]


def _need(kind: Tracker) -> None:
    try:
        if kind is Tracker.TENSORBOARD:
            import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
        else:
            import mlflow  # noqa: F401
    except ImportError:
        raise ValueError(f"--track {kind.value}: the {kind.value} package is not installed ({EXTRA})") from None


def check(kind: str | Tracker | None) -> Tracker | None:
    """The tracker asked for, refused before any work if its package is missing."""
    if kind in (None, ""):
        return None
    try:
        tracker = Tracker(kind)
    except ValueError:
        raise ValueError(f"track must be one of {', '.join(t.value for t in Tracker)}; got {kind!r}") from None
    _need(tracker)
    return tracker


def check_uri(kind: str | Tracker | None, uri: str | None) -> None:
    """Refuse, before any work, a tracking URI the tracker cannot use: MLflow opens its store and
    lists one experiment; TensorBoard's log directory must be creatable."""
    tracker = check(kind)
    if tracker is None:
        return
    if tracker is Tracker.MLFLOW:
        import mlflow

        try:
            mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as e:  # any store error: the run would only fail at its end
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"track_uri: MLflow cannot use {uri or 'its default store'!r}: {first}") from None
    elif uri:
        try:
            Path(uri).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"track_uri: cannot create the TensorBoard log directory {uri!r}: {e}") from None


def _images(run_dir: Path, names: Iterable[str]) -> list[Path]:
    return [run_dir / n for n in names if (run_dir / n).is_file()]


# ----- TensorBoard ---------------------------------------------------------------------------
def _tensorboard_run(
    logdir: Path,
    config: Mapping[str, Any],
    rounds: list[tuple[int, dict[str, float]]],
    epsilons: list[float],
    final: Mapping[str, float],
    images: list[Path],
) -> None:
    import matplotlib.image as mpimg
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(logdir))
    try:
        writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)
        for step, metrics in rounds:
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
        for i, eps in enumerate(epsilons, start=1):
            writer.add_scalar("privacy/epsilon_spent", eps, i)
        for k, v in final.items():
            writer.add_scalar(k, v, 0)
        for path in images:
            img = mpimg.imread(str(path))
            writer.add_image(f"figure/{path.stem}", img[..., :3], 0, dataformats="HWC")
    finally:
        writer.close()


# ----- MLflow --------------------------------------------------------------------------------
def _mlflow_run(
    uri: str | None,
    experiment: str,
    name: str,
    config: Mapping[str, Any],
    tags: Mapping[str, str],
    rounds: list[tuple[int, dict[str, float]]],
    epsilons: list[float],
    final: Mapping[str, float],
    artifacts: list[Path],
) -> str:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    run = client.create_run(experiment_id, run_name=name, tags=dict(tags))
    run_id = run.info.run_id
    try:
        params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
        metrics = [mlflow.entities.Metric(_key(k), v, 0, step) for step, m in rounds for k, v in m.items()]
        metrics += [
            mlflow.entities.Metric("privacy/epsilon_spent", eps, 0, i) for i, eps in enumerate(epsilons, start=1)
        ]
        metrics += [mlflow.entities.Metric(_key(k), v, 0, 0) for k, v in final.items()]
        for start in range(0, max(len(params), 1), 100):  # MLflow's batch limits
            client.log_batch(run_id, params=params[start : start + 100])
        for start in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[start : start + 1000])
        for path in artifacts:
            client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    return run_id


def _key(k: str) -> str:
    """MLflow metric names allow letters, digits, _ - . / and spaces."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in k)


# ----- entry points --------------------------------------------------------------------------
def track_run(
    run_dir: str | Path,
    kind: str | Tracker,
    *,
    uri: str | None = None,
    experiment: str | None = None,
    tags: Mapping[str, str] | None = None,
    logdir: str | Path | None = None,
) -> dict[str, Any]:
    """Log one run directory. TensorBoard writes to ``logdir`` (default RUN_DIR/tensorboard);
    MLflow to ``uri`` (default: MLflow's own, i.e. $MLFLOW_TRACKING_URI, else MLflow's default sqlite:///mlflow.db), in the
    experiment ``experiment`` (default: ``fedpers-ALGORITHM``). Returns where it went."""
    tracker = check(kind)
    assert tracker is not None
    path = Path(run_dir)
    run = read_run(path)
    result = run.get("result", {})
    config = run["config"]
    rounds = round_series(run["rounds"])
    epsilons = epsilon_after_each_release(run, result)
    final = final_metrics(result)
    images = _images(path, result.get("plots", []))
    if tracker is Tracker.TENSORBOARD:
        target = Path(logdir) if logdir is not None else path / "tensorboard"
        _tensorboard_run(target, config, rounds, epsilons, final, images)
        return {"tracker": tracker.value, "logdir": str(target)}
    name = experiment or f"fedpers-{config.get('algorithm', 'run')}"
    artifacts = images + [p for p in (path / "result.json", path / "config.json") if p.is_file()]
    run_tags = {"algorithm": str(config.get("algorithm")), "run_dir": str(path.resolve()), **(tags or {})}
    run_id = _mlflow_run(uri, name, path.name, config, run_tags, rounds, epsilons, final, artifacts)
    return {"tracker": tracker.value, "experiment": name, "run_id": run_id}


def track_sweep(sweep_dir: str | Path, kind: str | Tracker, *, uri: str | None = None) -> dict[str, Any]:
    """Log a sweep: one tracked run per grid point, grouped (see the module docstring)."""
    tracker = check(kind)
    assert tracker is not None
    out = Path(sweep_dir)
    if not (out / "sweep.json").is_file():
        raise ValueError(f"{out} is not a finished sweep directory (no sweep.json)")
    summary = json.loads((out / "sweep.json").read_text())
    spec = summary.get("spec", {})
    sweep = str(spec.get("name", out.name))
    figures = [out / f for f in summary.get("figures", []) if (out / f).is_file()]
    tracked = []
    for point_file in sorted((out / "points").glob("*.json")):
        point = json.loads(point_file.read_text())
        label = point.get("label")
        overrides = point.get("overrides", {})
        name = (
            f"{point_file.stem}" + (f" {label}" if label else "") + "".join(f" {k}={v}" for k, v in overrides.items())
        )
        config = {"algorithm": spec.get("algorithm"), **spec.get("base", {}), **overrides, "sweep": sweep}
        rows = point.get("rows", [])
        series = [
            (
                int(r.get("repetition", i)),
                {f"point/{k}": float(v) for k, v in r.items() if _number(v) and k != "repetition"},
            )
            for i, r in enumerate(rows)
        ]
        means: dict[str, float] = {}
        for _, m in series:
            for k, v in m.items():
                means.setdefault(k, 0.0)
                means[k] += v / len(series)
        final = {k.replace("point/", "mean/", 1): v for k, v in means.items()}
        if tracker is Tracker.TENSORBOARD:
            _tensorboard_run(out / "tensorboard" / point_file.stem, config, series, [], final, [])
        else:
            tags = {
                "sweep": sweep,
                "algorithm": str(spec.get("algorithm")),
                "sweep_dir": str(out.resolve()),
                "label": str(label or ""),
            }
            _mlflow_run(uri, f"fedpers-sweep-{sweep}", name, config, tags, series, [], final, [])
        tracked.append(name)
    if tracker is Tracker.TENSORBOARD and figures:
        _tensorboard_run(out / "tensorboard" / "figures", {"sweep": sweep}, [], [], {}, figures)
    elif figures:
        _mlflow_run(
            uri,
            f"fedpers-sweep-{sweep}",
            "figures",
            {"sweep": sweep},
            {"sweep": sweep},
            [],
            [],
            {},
            [*figures, out / "sweep.json"],
        )
    return {"tracker": tracker.value, "points": tracked}
