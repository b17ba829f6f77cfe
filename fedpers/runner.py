"""Runs one experiment on a runtime and writes its run directory."""
from __future__ import annotations

import enum
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedpers import config as config_lib
from fedpers.config import field
from fedpers.experiments.base import Experiment
from fedpers.privacy import Privatizer
from fedpers.results import LEDGER_LOG, RunDirectory, default_run_dir
from fedpers.seeds import split_seed  # noqa: F401  (re-exported: fedpers.runner.split_seed)
from fedpers.runtime.driver import RoundRecord


class Runtime(str, enum.Enum):
    LOCAL = "local"
    FLOWER = "flower"


@dataclass(frozen=True)
class RuntimeOptions:
    """Where the protocol runs; shared by every algorithm."""

    runtime: Runtime = field(Runtime.LOCAL, "local: batched on one device; flower: Flower simulation on Ray")
    nodes: int = field(8, "Flower SuperNodes (virtual clients), each holding a partition of the units", ge=1)
    users_per_node: int = field(0, "units per node (0: split all units evenly over --nodes)", ge=0)
    ray_address: str = field("", "attach the Flower simulation to this Ray cluster (default: start a local Ray)")
    client_cpus: float = field(1.0, "CPUs per Flower client actor", gt=0.0)
    client_gpus: float = field(0.0, "GPU share per Flower client actor", ge=0.0)
    min_fraction: float = field(1.0, "fraction of nodes that must reply acceptably for a round to proceed", gt=0.0, le=1.0)
    round_timeout: float = field(600.0, "seconds to wait for client replies in a round", gt=0.0)
    node_partitions: str = field("", "deployment: 'NODE_ID=P ...' assigns partitions to authenticated SuperNode ids (from `flwr supernode register`); nodes not listed take part in nothing, whatever they claim")
    secure_noise: bool = field(False, "draw DP noise from OS entropy with floating-point-safe samplers (OpenDP); not reproducible by seed. Default for flwr run")


def execute(
    experiment: Experiment,
    cfg: Any,
    options: RuntimeOptions | None = None,
    *,
    out: str | Path | None = None,
    progress: bool = True,
    write: bool = True,
    grid: Any = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run ``cfg`` and return the result dict (also written to ``out`` unless ``write`` is false).

    ``grid``: a Flower Grid (inside a ServerApp started by ``flwr run``) to run on instead of
    starting a simulation; only with the flower runtime. ``resume``: continue the killed run
    in ``out`` from its last checkpoint (see :func:`resume_run`).
    """
    options = options or RuntimeOptions()
    config_lib.validate(cfg)
    config_lib.validate(options)
    if grid is not None and options.runtime is not Runtime.FLOWER:
        raise ValueError("runtime must be flower when a Flower grid is given")
    if resume and not (write and out):
        raise ValueError("resume needs the run directory (out) to continue")
    start = time.perf_counter()
    user_cfg = cfg
    cfg, noise_seed = split_seed(user_cfg)
    protocol = experiment.protocol(cfg)
    evaluator = experiment.evaluator(cfg, protocol)
    run_dir = None
    if write:
        run_dir = RunDirectory(out, resume=resume) if out else RunDirectory(default_run_dir(experiment.name, getattr(user_cfg, "seed", 0)))
    rounds: list[dict[str, Any]] = []
    privatizer = Privatizer(noise_seed, secure=options.secure_noise)
    checkpointer = None
    if run_dir is not None:
        from fedpers.provenance import provenance
        from fedpers.runtime.checkpoint import Checkpointer

        saved = {"algorithm": experiment.name, **config_lib.to_dict(user_cfg), "runtime": config_lib.to_dict(options)}
        checkpointer = Checkpointer(run_dir.path / CHECKPOINT, _digest(saved))
        record = provenance()
        if resume:
            record = _prepare_resume(run_dir, saved, experiment, evaluator, privatizer, checkpointer, rounds, getattr(cfg, "device", "cpu"), record)
        else:
            run_dir.write_json("config.json", saved)
            run_dir.write_json("constants.json", experiment.describe(cfg, protocol))
        run_dir.write_json("provenance.json", record)
        privatizer.ledger.on_append = run_dir.append_release

    def on_round(record: RoundRecord, state: Any) -> None:
        record.metrics.update(evaluator.round_metrics(record.round, state))
        rounds.append(record.to_dict())
        if run_dir is not None:
            run_dir.append_round(rounds[-1])

    try:
        if options.runtime is Runtime.LOCAL:
            from fedpers.runtime.local import run_local

            chunk = experiment.chunk_size(cfg)
            source = experiment.unit_source(cfg)
            state, _ = run_local(protocol, source, privatizer, chunk_size=chunk, on_round=on_round, progress=progress, checkpoint=checkpointer)
        else:
            from fedpers.runtime.flower import run_flower

            state, _ = run_flower(experiment, cfg, protocol, privatizer, options, on_round=on_round, progress=progress, grid=grid, checkpoint=checkpointer)
        privatizer.ledger.settle()
        if run_dir is not None:  # the private result is kept before any evaluation can fail
            run_dir.write_json("ledger.json", [r.to_dict() for r in privatizer.ledger])
            if isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
                run_dir.write_arrays("final_state.npz", state)
        final = evaluator.final(state)
    except BaseException as e:
        privatizer.ledger.settle()
        if run_dir is not None:
            run_dir.write_json("ledger.json", [r.to_dict() for r in privatizer.ledger])
            run_dir.write_json("error.json", {"status": "failed", "error": f"{type(e).__name__}: {e}", "rounds_completed": len(rounds), "traceback": traceback.format_exc()})
            run_dir.close()
        raise
    privacy = experiment.privacy_summary(cfg, protocol, privatizer.ledger)
    result = {
        "algorithm": experiment.name,
        "status": "completed",
        "runtime": options.runtime.value,
        **{k: privacy[k] for k in ("epsilon", "delta", "noise_multiplier") if k in privacy},
        **final,
        "privacy": privacy,
        "seconds": time.perf_counter() - start,
    }
    warnings = experiment.result_warnings(cfg, result)  # a private result no better than a trivial one says so
    if warnings:
        result["warnings"] = warnings
    if run_dir is not None:
        run_dir.write_json("provenance.json", {**record, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        run_dir.remove("error.json")
        from fedpers.plots import privacy_title

        result["plots"] = run_dir.plot_rounds(
            rounds, experiment.plot_keys(), privacy_title(experiment.name, {"delta": getattr(cfg, "delta", None), **privacy}),
            round_axis=experiment.round_axis, baselines=final.get("baselines"),
        )
        result["run_dir"] = str(run_dir.path)
        run_dir.write_json("result.json", result)
        run_dir.close()
    result["_rounds"] = rounds
    result["_state"] = state
    return result


CHECKPOINT = "checkpoint.pt"


def _digest(saved: dict[str, Any]) -> str:
    import hashlib

    from fedpers.results import dumps

    return hashlib.sha256(dumps(saved, indent=None).encode()).hexdigest()


def _prepare_resume(
    run_dir: RunDirectory, saved: dict[str, Any], experiment: Experiment, evaluator: Any, privatizer: Privatizer,
    checkpointer: Any, rounds: list[dict[str, Any]], device: str, record: dict[str, Any],
) -> dict[str, Any]:
    """Load the checkpoint, the releases on disk and the round lines a resumed run continues from.

    Releases after the checkpoint were drawn but never published (the checkpoint precedes any
    publication): the resumed run re-draws them from the restored generators and the ledger
    keeps each once. Round lines after the checkpoint are dropped for the same reason.
    """
    import json

    from fedpers.privacy.ledger import Ledger, Release
    from fedpers.results import dumps
    from fedpers.runtime import checkpoint as checkpoint_lib

    stored = json.loads((run_dir.path / "config.json").read_text())
    if stored != json.loads(dumps(saved)):
        raise ValueError(f"resume: {run_dir.path}/config.json differs from the configuration given; a run resumes only with its own")
    ckpt = checkpoint_lib.load(run_dir.path / CHECKPOINT, device) if (run_dir.path / CHECKPOINT).exists() else None
    if ckpt is not None and ckpt.run != checkpointer.run:
        raise ValueError(f"resume: {run_dir.path}/{CHECKPOINT} was written by a run with another configuration than config.json; it cannot continue this one")
    lines = run_dir.recorded_releases()
    done = int(ckpt.privatizer.get("releases", 0)) if ckpt is not None else 0
    if done > len(lines):
        raise ValueError(f"resume: the checkpoint counts {done} releases but {LEDGER_LOG} holds {len(lines)}; the run directory is damaged")
    privatizer.ledger = Ledger([Release.from_dict(d) for d in lines[:done]])
    privatizer.ledger.expect(lines[done:], lambda r: json.loads(dumps(r.to_dict(), indent=None)))
    next_round = ckpt.next_round if ckpt is not None else 0
    kept = [r for r in run_dir.recorded_rounds() if int(r.get("round", -1)) < next_round]
    if ckpt is not None and len(kept) < next_round:  # killed between the checkpoint and its round line
        from fedpers.runtime.driver import RoundRecord

        last = RoundRecord.from_dict(ckpt.records[-1])
        last.metrics.update(evaluator.round_metrics(last.round, ckpt.state))
        kept.append(last.to_dict())
    rounds.extend(kept)
    run_dir.rewrite_rounds(kept)
    checkpointer.resume = ckpt
    previous = json.loads((run_dir.path / "provenance.json").read_text()) if (run_dir.path / "provenance.json").is_file() else {}
    code = {k: record.get(k) for k in ("fedpers", "git", "libraries")}
    if previous and code != {k: previous.get(k) for k in code}:
        import logging

        logging.getLogger("fedpers").warning(
            "resume: the code or libraries differ from those that started %s (see provenance.json); the result may differ from an uninterrupted run", run_dir.path)
    resumes = list(previous.get("resumed", [])) + [{"at": record.get("started"), "from_round": next_round, "releases_kept": done, "command": record.get("command"), **code}]
    return {**previous, "resumed": resumes}


def resume_run(run_dir: str | Path, *, progress: bool = True, grid: Any = None) -> dict[str, Any]:
    """Continue a killed run in ``run_dir`` from its last checkpoint: same configuration, same
    random streams, the same final result and ledger as an uninterrupted run with its seed.
    ``grid``: the Flower Grid of a deployment (``flwr run . --run-config "resume='DIR'"``)."""
    import json

    from fedpers.experiments import ALGORITHMS, experiment

    path = Path(run_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"resume: {path} is not a fedpers run directory (no config.json)")
    if (path / "result.json").is_file():
        raise ValueError(f"resume: {path} holds a completed run (result.json); nothing to resume")
    saved = json.loads((path / "config.json").read_text())
    name = saved.pop("algorithm", None)
    if name not in ALGORITHMS:
        raise ValueError(f"resume: {path}/config.json names algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    exp = experiment(name)
    options = config_lib.build(RuntimeOptions, saved.pop("runtime", {}))
    cfg = config_lib.build(exp.config_type, saved)
    return execute(exp, cfg, options, out=path, progress=progress, resume=True, grid=grid)
