"""The fedpers ServerApp for ``flwr run .`` (``[tool.flwr.app.components] serverapp``).

Thin by design: it reads ``context.run_config`` (see :func:`fedpers.app.from_run_config`)
and runs the experiment with :func:`fedpers.runner.execute` on the Grid Flower gives it:
discovery, the shared round loop with verification and DP aggregation, the run directory.
"""

# Refuse to run unless the fedpers imported here is this app's own (the check is loaded by path, not through fedpers).
import importlib.util as _util
from pathlib import Path as _Path

_spec = _util.spec_from_file_location(
    "_fedpers_fab_integrity", _Path(__file__).resolve().parents[1] / "fedpers" / "deploy" / "integrity.py"
)
_integrity = _util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_integrity)  # type: ignore[union-attr]
_integrity.require_fab_code(_Path(__file__).resolve().parents[1])
from logging import ERROR, INFO

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from fedpers.app import error_line, from_run_config, register_app_entries
from fedpers.results.rundir import dumps
from fedpers.runner import execute, resume_run

register_app_entries(_Path(__file__).resolve().parents[1])  # algorithms this app's pyproject registers
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run(grid, context)
    except BaseException as e:  # one line a caller can read the kind of error from (fedpers.app.simulate raises it)
        log(ERROR, "%s", error_line(e))
        raise


def run(grid: Grid, context: Context) -> None:
    deployment = type(grid).__name__ == "HttpGrid"  # a deployment, never a simulation
    run_config = dict(context.run_config)
    if deployment:  # a config-file only from the lab's directory on this machine
        from fedpers.deploy.serverside import confine_config_file, lab_config_dir

        run_config = confine_config_file(run_config, lab_config_dir())
    job = from_run_config(run_config)
    # The lab's policy ($FEDPERS_POLICY) before any work: the run is charged to the federation's ledger.
    from fedpers.runtime.flower.policy import active_policy, admit_run

    policy = active_policy()
    if deployment:  # no user data on this machine; every check before the charge (fedpers/deploy/serverside.py)
        from fedpers.deploy.pulls import quick_grid_pulls
        from fedpers.deploy.serverside import (
            deployed,
            preflight,
            private_files,
            refuse_seeded_node_noise,
            refuse_server_data,
        )

        private_files()
        refuse_server_data(job)
        refuse_seeded_node_noise(job)
        job = deployed(job)
        if policy is not None:
            preflight(policy, job)
        quick_grid_pulls(grid)  # shorter waits for reply objects
    if policy is not None:
        charge = admit_run(policy, job, str(context.run_id))
        log(
            INFO,
            "fedpers policy: run admitted, charged epsilon=%g delta=%g to users %s of federation %s",
            charge.epsilon,
            charge.delta,
            list(charge.units),
            policy.federation,
        )
    run_grid: object = grid
    if deployment:  # no round is sent once the run is stopped or past the policy's max-seconds
        import math
        import time

        from fedpers.deploy.serverside import BoundedGrid

        run_grid = BoundedGrid(grid, time.monotonic() + (policy.max_seconds if policy is not None else math.inf))
    if job.resume is not None:
        result = resume_run(job.resume, progress=False, grid=run_grid)
    else:
        result = execute(job.experiment, job.cfg, job.options, out=job.out, progress=False, grid=run_grid)
    summary = {k: v for k, v in result.items() if not k.startswith("_") and k not in ("baselines", "privacy")}
    log(INFO, "fedpers result: %s", dumps(summary, indent=None))
