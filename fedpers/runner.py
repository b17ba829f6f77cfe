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
from fedpers.results import RunDirectory, default_run_dir
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
) -> dict[str, Any]:
    """Run ``cfg`` and return the result dict (also written to ``out`` unless ``write`` is false).

    ``grid``: a Flower Grid (inside a ServerApp started by ``flwr run``) to run on instead of
    starting a simulation; only with the flower runtime.
    """
    options = options or RuntimeOptions()
    config_lib.validate(cfg)
    config_lib.validate(options)
    if grid is not None and options.runtime is not Runtime.FLOWER:
        raise ValueError("runtime must be flower when a Flower grid is given")
    start = time.perf_counter()
    user_cfg = cfg
    cfg, noise_seed = split_seed(user_cfg)
    protocol = experiment.protocol(cfg)
    evaluator = experiment.evaluator(cfg, protocol)
    run_dir = None
    if write:
        run_dir = RunDirectory(out) if out else RunDirectory(default_run_dir(experiment.name, getattr(user_cfg, "seed", 0)))
    rounds: list[dict[str, Any]] = []
    privatizer = Privatizer(noise_seed, secure=options.secure_noise)
    if run_dir is not None:
        privatizer.ledger.on_append = run_dir.append_release
        from fedpers.provenance import provenance

        record = provenance()
        run_dir.write_json("provenance.json", record)
        run_dir.write_json("config.json", {"algorithm": experiment.name, **config_lib.to_dict(user_cfg), "runtime": config_lib.to_dict(options)})
        run_dir.write_json("constants.json", experiment.describe(cfg, protocol))

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
            state, _ = run_local(protocol, source, privatizer, chunk_size=chunk, on_round=on_round, progress=progress)
        else:
            from fedpers.runtime.flower import run_flower

            state, _ = run_flower(experiment, cfg, protocol, privatizer, options, on_round=on_round, progress=progress, grid=grid)
        if run_dir is not None:  # the private result is kept before any evaluation can fail
            run_dir.write_json("ledger.json", [r.to_dict() for r in privatizer.ledger])
            if isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
                run_dir.write_arrays("final_state.npz", state)
        final = evaluator.final(state)
    except BaseException as e:
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
    if run_dir is not None:
        run_dir.write_json("provenance.json", {**record, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        result["plots"] = run_dir.plot_rounds(rounds, experiment.plot_keys(), f"{experiment.name}, ε={privacy.get('target_epsilon', '?')}")
        result["run_dir"] = str(run_dir.path)
        run_dir.write_json("result.json", result)
        run_dir.close()
    result["_rounds"] = rounds
    result["_state"] = state
    return result
