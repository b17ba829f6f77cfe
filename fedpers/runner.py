"""Runs one experiment on a runtime and writes its run directory."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpers import config as config_lib
from fedpers.config import DpModel, Neighbours, RunConfig
from fedpers.configs.runtime import Runtime, RuntimeOptions
from fedpers.experiments.base import Evaluator, Experiment
from fedpers.privacy import Calibrations, Privatizer
from fedpers.privacy.accountant import how_accounted
from fedpers.privacy.distributed import NodeSidePrivatizer, RecordingCalibrations
from fedpers.protocols.base import Protocol, State
from fedpers.results.run_result import RunResult
from fedpers.results.rundir import LEDGER_LOG, RunDirectory, default_run_dir
from fedpers.runtime.checkpoint import Checkpointer
from fedpers.runtime.driver import RoundRecord
from fedpers.runtime.progress import phase
from fedpers.seeds import derived_seed, split_seed


@dataclass
class Plan:
    """A run resolved once (validated, seeds split, protocol calibrated): every later step reads
    its config from here, none goes back up for it."""

    experiment: Experiment[Any, Any]
    given: RunConfig
    """The config as given (its seed names the run; saved in config.json)."""
    cfg: RunConfig
    """The config the protocol runs with (its noise seed split off, :func:`split_seed`)."""
    options: RuntimeOptions
    protocol: Protocol
    calibrations: Calibrations
    evaluator: Evaluator
    privatizer: Privatizer
    rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Round records so far (a resumed run starts with the checkpointed ones)."""

    @property
    def saved(self) -> dict[str, Any]:
        """What config.json holds: the algorithm, the config as given and the runtime options."""
        runtime = config_lib.to_dict(self.options)
        if runtime.get("server_data") is True:  # the default: config.json as before the option existed (resumable)
            del runtime["server_data"]
        return {
            "algorithm": self.experiment.name,
            **config_lib.to_dict(self.given),
            "runtime": runtime,
        }


class NoServerData(Evaluator):
    """The evaluator of a run whose server holds no user data (a deployment): no metric, no baseline."""

    def final_phase(self) -> str:
        return "nothing (the server holds no user data)"

    def final(self, state: State) -> dict[str, Any]:
        return {
            "evaluation": "unavailable: the server holds no user data (a deployment); the private release is in "
            "final_state.npz and its privacy below"
        }


def execute(
    experiment: Experiment[Any, Any],
    cfg: RunConfig,
    options: RuntimeOptions | None = None,
    *,
    out: str | Path | None = None,
    progress: bool = True,
    write: bool = True,
    grid: Any = None,
    resume: bool = False,
    reuse: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run ``cfg`` and return its result (also written to ``out`` unless ``write`` is false): the
    :class:`RunResult`'s dict (what result.json holds), with the round records under ``_rounds``
    and the final state under ``_state``.

    The steps: :func:`resolve` the run, open (or resume) its run directory
    (:meth:`RunDirectory.start <fedpers.results.rundir.RunDirectory.start>` / :func:`resume_directory`),
    :func:`drive` the protocol on the runtime, evaluate (the experiment's Evaluator), and record
    (:meth:`RunDirectory.finish <fedpers.results.rundir.RunDirectory.finish>`). ``grid``: a Flower Grid
    (inside a ServerApp started by ``flwr run``) to run on instead of starting a simulation; only
    with the flower runtime. ``resume``: continue the killed run in ``out`` from its last
    checkpoint (see :func:`resume_run`). ``reuse``: rows of the experiment's shared baselines computed
    by another run with the same :meth:`~fedpers.experiments.base.Experiment.baseline_key` (a sweep's),
    reported as given instead of computed again (the result lists them under ``baselines_reused``).
    """
    start = time.perf_counter()
    if resume and not (write and out):
        raise ValueError("resume needs the run directory (out) to continue")
    plan = resolve(experiment, cfg, options, flower_grid=grid is not None)
    if reuse:
        plan.evaluator.reuse_baselines(reuse)
    if plan.options.runtime is Runtime.FLOWER and grid is None:
        return simulated(plan, out, resume=resume, write=write, progress=progress)
    run_dir, checkpointer = open_run_directory(plan, out, resume) if write else (None, None)
    try:
        state = drive(plan, run_dir, checkpointer, grid=grid, progress=progress)
        with phase(f"{experiment.name}: evaluating {plan.evaluator.final_phase()}", progress):
            final = plan.evaluator.final(state)
        result = result_of(plan, final, time.perf_counter() - start)
    except BaseException as e:
        if run_dir is not None:
            run_dir.fail(plan.privatizer.ledger, e, len(plan.rounds))
        raise
    if run_dir is not None:
        result = run_dir.finish(result, plan.rounds, plan.experiment, plan.cfg)
    return {**result.to_dict(), "_rounds": plan.rounds, "_state": state}


def simulated(plan: Plan, out: str | Path | None, *, resume: bool, write: bool, progress: bool) -> dict[str, Any]:
    """The run of ``plan`` in Flower's simulation, through Flower's supported path (:func:`fedpers.app.simulate`:
    a private simulation SuperLink and ``flwr run``): the simulation's ServerApp resolves the same plan from
    its ``config.json`` and writes the run directory; the result is read back from there, as :func:`execute`
    returns it. Resolved here first, so a bad config or split is refused before any process starts.
    ``write=False``: the run directory is a scratch one, removed afterwards."""
    import json
    import shutil
    import tempfile

    import numpy as np
    import torch

    from fedpers.app import node_noise_seed, simulate
    from fedpers.results.rundir import check_free

    scratch = Path(tempfile.mkdtemp(prefix="fedpers-run-")) if not write else None
    try:
        if scratch is not None:
            path = scratch / "run"
        elif out:
            path = Path(out)
            if not resume:
                check_free(path)
        else:
            path = default_run_dir(plan.experiment.name, plan.given.seed)
        simulate(
            plan.experiment,
            json.loads(_dumps_saved(plan.saved)),
            plan.options,
            path,
            resume=resume,
            rounds=plan.protocol.num_rounds,
            final_phase=plan.evaluator.final_phase(),
            progress=progress,
            noise_seed=node_noise_seed(plan.privatizer),
        )
        result = json.loads((path / "result.json").read_text())
        rounds = [json.loads(line) for line in (path / "rounds.jsonl").read_text().splitlines() if line.strip()]
        state: Any = None
        if (path / "final_state.npz").is_file():
            with np.load(path / "final_state.npz") as kept:
                state = {k: torch.from_numpy(kept[k]) for k in kept.files}
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return {**result, "_rounds": rounds, "_state": state}


def _dumps_saved(saved: dict[str, Any]) -> str:
    from fedpers.results.rundir import dumps

    return dumps(saved, indent=None)


def resolve(
    experiment: Experiment[Any, Any],
    cfg: RunConfig,
    options: RuntimeOptions | None = None,
    *,
    flower_grid: bool = False,
) -> Plan:
    """Validate, split the noise seed off, calibrate and build the protocol and its evaluator."""
    options = options or RuntimeOptions()
    config_lib.validate(cfg)
    config_lib.validate(options)
    if flower_grid and options.runtime is not Runtime.FLOWER:
        raise ValueError("runtime must be flower when a Flower grid is given")
    run_cfg, noise_seed = split_seed(cfg)
    central = options.dp_model is DpModel.CENTRAL
    if options.dp_model is DpModel.LOCAL and run_cfg.neighbours is not Neighbours.REPLACE_ONE:
        raise ValueError(
            f"neighbours {run_cfg.neighbours.value} needs dp_model central or distributed: local DP's per-unit "
            "releases are accounted for replace-one neighbours only"
        )
    calibrations = Calibrations() if central else RecordingCalibrations()
    protocol = experiment.protocol(run_cfg, calibrations)
    if central:
        privatizer = Privatizer(noise_seed, secure=options.secure_noise, neighbours=run_cfg.neighbours)
    else:  # distributed or local DP: the nodes add the noise (fedpers.runtime.distributed)
        from fedpers.runtime.distributed import node_side_privatizer, with_node_noise

        assert isinstance(calibrations, RecordingCalibrations)
        privatizer = node_side_privatizer(
            protocol,
            experiment.num_units(run_cfg),
            calibrations,
            options,
            noise_seed,
            derived_seed(run_cfg.seed, "rotation"),
        )
        protocol = with_node_noise(protocol, privatizer, experiment.num_units(run_cfg))
    evaluator = experiment.evaluator(run_cfg, protocol) if options.server_data else NoServerData()
    return Plan(experiment, cfg, run_cfg, options, protocol, calibrations, evaluator, privatizer)


def open_run_directory(plan: Plan, out: str | Path | None, resume: bool) -> tuple[RunDirectory, Checkpointer]:
    """The run directory (``out``, or a new one under ``runs/``) started, or resumed from its
    checkpoint; every release is written there the moment it is drawn."""
    from fedpers.results.provenance import provenance

    path = out if out else default_run_dir(plan.experiment.name, plan.given.seed)
    run_dir = RunDirectory(path, resume=resume)
    saved = plan.saved
    checkpointer = Checkpointer(run_dir.path / CHECKPOINT, _digest(saved))
    if resume:
        resume_directory(plan, run_dir, checkpointer, provenance())
    else:
        run_dir.start(saved, plan.experiment.describe(plan.cfg, plan.protocol), provenance())
    plan.privatizer.ledger.on_append = run_dir.append_release
    return run_dir, checkpointer


def drive(
    plan: Plan,
    run_dir: RunDirectory | None,
    checkpointer: Checkpointer | None,
    *,
    grid: Any = None,
    progress: bool = True,
) -> Any:
    """Every round of the protocol on the runtime the options name; returns the final state.

    Each round's metrics go to the round log as it finishes (with what the evaluator keeps for
    later, so a resumed run evaluates alike); the private result is kept before any evaluation."""

    def on_round(record: RoundRecord, state: Any) -> None:
        record.metrics.update(plan.evaluator.round_metrics(record.round, state))
        plan.rounds.append(record.to_dict())
        if run_dir is not None:
            run_dir.append_round(plan.rounds[-1])
            run_dir.keep_evaluator_state(plan.evaluator.state_dict())

    experiment, cfg, options = plan.experiment, plan.cfg, plan.options
    if options.runtime is Runtime.LOCAL:
        from fedpers.runtime.local import run_local

        state, _ = run_local(
            plan.protocol,
            experiment.unit_source(cfg),
            plan.privatizer,
            chunk_size=experiment.chunk_size(cfg),
            on_round=on_round,
            progress=progress,
            checkpoint=checkpointer,
            companions=plan.evaluator.companions(),
        )
    else:
        from fedpers.app import run_flower
        from fedpers.privacy.accountant import Calibrations

        # distributed or local DP: the nodes build the protocol from the calibrations alone; the server's
        # differs only in the noise it assumes after a release (with_node_noise), which no node computes with
        node_protocol = (
            None
            if options.dp_model is DpModel.CENTRAL
            else experiment.protocol(plan.cfg, Calibrations(plan.calibrations.table))
        )

        state, _ = run_flower(
            experiment,
            cfg,
            plan.protocol,
            plan.privatizer,
            options,
            on_round=on_round,
            progress=progress,
            grid=grid,
            checkpoint=checkpointer,
            calibrations=plan.calibrations.table,
            node_protocol=node_protocol,
        )
    plan.privatizer.ledger.settle()
    if run_dir is not None:
        run_dir.keep_private_result(plan.privatizer.ledger, state)
    return state


def result_of(plan: Plan, final: dict[str, Any], seconds: float) -> RunResult:
    """The run's result: the algorithm's metrics with the (ε, δ) the accountant gives its ledger,
    and a warning for each trivial baseline the private result does not beat."""
    ledger = plan.privatizer.ledger
    privacy = plan.experiment.privacy_summary(plan.cfg, plan.protocol, ledger)
    # every view names the trust model, bits, the accountant that gave ε and the composition
    accounted = how_accounted(ledger, str(privacy.get("accountant", "pld")))
    privacy = {**privacy, **{k: v for k, v in accounted.items() if v is not None}}
    privacy["dp_model"] = plan.options.dp_model.value
    if isinstance(plan.privatizer, NodeSidePrivatizer):  # who added the noise, and its public parameters
        node_plan = plan.privatizer.plan
        privacy = {**privacy, "noise_multiplier": node_plan.noise_multiplier, "trust_model": node_plan.summary()}
        if node_plan.model is DpModel.DISTRIBUTED:
            privacy["bits"] = node_plan.bits
        else:  # the paper calibrates a central Gaussian sum: no comparison for each unit's own noise
            privacy.pop("paper_epsilon_same_noise", None)
    per_release = release_multipliers(plan.privatizer.ledger)
    if per_release:
        privacy = {**privacy, "noise_multipliers": per_release}
    final = {**final, **wrap_totals(plan.rounds)}
    result = RunResult.completed(plan.experiment.name, plan.options.runtime.value, privacy, final, seconds)
    warnings = plan.experiment.result_warnings(plan.cfg, result.to_dict())
    cause = trust_model_cause(privacy, final)
    if cause:  # a metric's warning names the trust model where it is the likely cause
        warnings = [
            {**w, "text": f"{w['text']} ({cause})"} if isinstance(w, dict) and w.get("metric") else w for w in warnings
        ]
    return result.with_warnings(warnings) if warnings else result


def trust_model_cause(privacy: dict[str, Any], final: dict[str, Any]) -> str | None:
    """How the run's trust model degrades its metrics, where it does: local DP's per-unit noise, or a
    distributed run's wrapped sums (its Skellam noise is central's variance, so not a cause by itself)."""
    model = privacy.get("dp_model")
    if model == "local":
        return (
            "trust model local: every unit carries its own noise, so a sum of U units holds √U× the central "
            "noise; compare --dp-model central or distributed"
        )
    if model == "distributed" and int(final.get("modular_wraps", 0) or 0) > 0:
        return (
            f"trust model distributed: {int(final['modular_wraps'])} coordinates wrapped mod 2^{privacy.get('bits')}; "
            "use more --bits"
        )
    return None


def release_multipliers(ledger: Any) -> dict[str, float]:
    """Each kind of release's noise multiplier z (its name with round numbers written N), where the run's
    Gaussian releases do not all share one z: a summary's single z would then misstate every release
    but the first. Empty where they share it."""
    import re

    found: dict[str, float] = {}
    for release in ledger:
        z = release.noise_multiplier
        if 0 < z < float("inf"):
            found.setdefault(re.sub(r"\d+", "N", release.name), z)
    return found if len(set(found.values())) > 1 else {}


WRAP_COUNTS = ("modular_wraps", "suspected_wraps")
"""Round diagnostics of a modular sum (distributed DP) that a run totals in its result."""


def wrap_totals(rounds: list[dict[str, Any]]) -> dict[str, int]:
    """Each wrap count the rounds recorded, totalled over them (absent where no round records it:
    central and local DP have no modular sum; the Flower runtime cannot know the exact count)."""
    return {k: int(sum(r[k] for r in rounds if k in r)) for k in WRAP_COUNTS if any(k in r for r in rounds)}


CHECKPOINT = "checkpoint.pt"


def _digest(saved: dict[str, Any]) -> str:
    import hashlib

    from fedpers.results.rundir import dumps

    return hashlib.sha256(dumps(saved, indent=None).encode()).hexdigest()


def resume_directory(plan: Plan, run_dir: RunDirectory, checkpointer: Checkpointer, record: dict[str, Any]) -> None:
    """Load the checkpoint, the releases on disk, the round lines and the evaluator's memory a
    resumed run continues from.

    Releases after the checkpoint were drawn but never published (the checkpoint precedes any
    publication): the resumed run re-draws them from the restored generators and the ledger
    keeps each once. Round lines after the checkpoint are dropped for the same reason.
    """
    import json

    from fedpers.privacy.ledger import Ledger, Release
    from fedpers.results.rundir import dumps
    from fedpers.runtime import checkpoint as checkpoint_lib

    saved = plan.saved
    stored = json.loads((run_dir.path / "config.json").read_text())
    if stored != json.loads(dumps(saved)):
        raise ValueError(
            f"resume: {run_dir.path}/config.json differs from the configuration given; a run resumes only with its own"
        )
    ckpt = (
        checkpoint_lib.load(
            run_dir.path / CHECKPOINT
        )  # on the host: the runtime's server puts the state where it keeps it
        if (run_dir.path / CHECKPOINT).exists()
        else None
    )
    if ckpt is not None and ckpt.run != checkpointer.run:
        raise ValueError(
            f"resume: {run_dir.path}/{CHECKPOINT} was written by a run with another configuration than config.json; it cannot continue this one"
        )
    lines = run_dir.recorded_releases()
    done = int(ckpt.privatizer.get("releases", 0)) if ckpt is not None else 0
    if done > len(lines):
        raise ValueError(
            f"resume: the checkpoint counts {done} releases but {LEDGER_LOG} holds {len(lines)}; the run directory is damaged"
        )
    plan.privatizer.ledger = Ledger([Release.from_dict(d) for d in lines[:done]])
    plan.privatizer.ledger.expect(lines[done:], lambda r: json.loads(dumps(r.to_dict(), indent=None)))
    next_round = ckpt.next_round if ckpt is not None else 0
    plan.evaluator.load_state_dict(run_dir.evaluator_state())  # the server's memory, on the host
    kept = [r for r in run_dir.recorded_rounds() if int(r.get("round", -1)) < next_round]
    if ckpt is not None and len(kept) < next_round:  # killed between the checkpoint and its round line
        last = RoundRecord.from_dict(ckpt.records[-1])
        last.metrics.update(plan.evaluator.round_metrics(last.round, ckpt.state))
        kept.append(last.to_dict())
    plan.rounds.extend(kept)
    run_dir.rewrite_rounds(kept)
    checkpointer.resume = ckpt
    run_dir.write_json("provenance.json", resumed_provenance(run_dir, record, next_round, done))


def resumed_provenance(
    run_dir: RunDirectory, record: dict[str, Any], next_round: int, releases_kept: int
) -> dict[str, Any]:
    """The first start's provenance with this resume added (warning if the code differs)."""
    import json

    previous = (
        json.loads((run_dir.path / "provenance.json").read_text())
        if (run_dir.path / "provenance.json").is_file()
        else {}
    )
    code = {k: record.get(k) for k in ("fedpers", "git", "libraries")}
    if previous and code != {k: previous.get(k) for k in code}:
        import logging

        logging.getLogger("fedpers").warning(
            "resume: the code or libraries differ from those that started %s (see provenance.json); the result may differ from an uninterrupted run",
            run_dir.path,
        )
    resumes = [
        *previous.get("resumed", []),
        {
            "at": record.get("started"),
            "from_round": next_round,
            "releases_kept": releases_kept,
            "command": record.get("command"),
            **code,
        },
    ]
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
