"""The fedpers ServerApp for ``flwr run .`` (``[tool.flwr.app.components] serverapp``).

Thin by design: it reads ``context.run_config`` (see :func:`fedpers.app.from_run_config`)
and runs the experiment with :func:`fedpers.runner.execute` on the Grid Flower gives it:
discovery, the shared round loop with verification and DP aggregation, the run directory.
"""
from logging import INFO

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from fedpers.app import from_run_config
from fedpers.results import dumps
from fedpers.runner import execute, resume_run

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    job = from_run_config(context.run_config)
    if type(grid).__name__ == "HttpGrid":  # a deployment, never a simulation: shorter waits for reply objects
        from fedpers.deploy.pulls import quick_grid_pulls

        quick_grid_pulls(grid)
    if job.resume is not None:
        result = resume_run(job.resume, progress=False, grid=grid)
    else:
        result = execute(job.experiment, job.cfg, job.options, out=job.out, progress=False, grid=grid)
    summary = {k: v for k, v in result.items() if not k.startswith("_") and k not in ("baselines", "privacy")}
    log(INFO, "fedpers result: %s", dumps(summary, indent=None))
