"""`fedpers deploy run`: ``flwr run`` + ``flwr log --stream`` + ``flwr ls``, exiting non-zero unless the run completed.

Public Flower CLI only (no internals): works on every Flower series fedpers installs beside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

FLWR_COMPLETED = "finished:completed"


def run_and_wait(
    app: str,
    superlink: str,
    run_config: str = "",
    extra: Sequence[str] = (),
    *,
    poll: float = 1.0,
    timeout: float = 0.0,
    env: dict[str, str] | None = None,
) -> tuple[int, str, str]:
    """Start the app on the SuperLink, stream its logs, wait until it finishes, and return
    (exit code, run id, final status): 0 only for ``finished:completed``.

    ``flwr run --stream`` of Flower 1.41 exits 0 whatever the run's outcome (it returns when the
    log stream ends, ``flwr/cli/run/run.py``), so a script cannot tell an aborted run from a
    completed one; this asks the SuperLink for the run's status (``flwr ls --run-id``)."""
    import json
    import shutil
    import subprocess
    import time

    flwr = shutil.which("flwr") or "flwr"
    cmd = [
        flwr,
        "run",
        app,
        superlink,
        "--format",
        "json",
        *(["--run-config", run_config] if run_config else []),
        *extra,
    ]
    started = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        info = json.loads(started.stdout[started.stdout.index("{") :])
    except ValueError:
        info = {}
    if not info.get("success") or not info.get("run-id"):
        print(started.stdout + started.stderr, end="")
        return 2, "", "not started"
    run_id = str(info["run-id"])
    print(f"started run {run_id}", flush=True)
    subprocess.run([flwr, "log", run_id, superlink, "--stream"], env=env)
    deadline = time.monotonic() + timeout if timeout > 0 else math.inf
    status = "unknown"
    while time.monotonic() < deadline:
        listed = subprocess.run(
            [flwr, "ls", superlink, "--run-id", run_id, "--format", "json"], capture_output=True, text=True, env=env
        )
        try:
            runs = json.loads(listed.stdout[listed.stdout.index("{") :]).get("runs", [])
            status = str(runs[0]["status"]) if runs else status
            details = str(runs[0].get("status-details", "")) if runs else ""
        except (ValueError, KeyError, IndexError):
            details = ""
        if status.startswith("finished"):
            print(f"run {run_id}: {status}" + (f" ({details})" if details else ""), flush=True)
            return (0 if status == FLWR_COMPLETED else 1), run_id, status
        time.sleep(poll)
    print(f"run {run_id}: still {status} after {timeout:g} s", flush=True)
    return 1, run_id, status
