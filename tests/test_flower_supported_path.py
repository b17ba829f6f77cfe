"""Flower's supported simulation path: `flwr run` on a private simulation SuperLink, the run handed over as data.

The fast tests here hold the pieces (no deprecated entry point anywhere, the job a ServerApp receives, the
staged app, the error and provenance records, the run's processes stopped, the progress read from the run
directory) and run the very ServerApp Flower loads on an in-process Grid; the slow ones run Flower itself:
`flwr run .` from a fresh clone, and (tests/test_flower_simulation.py, tests/test_resume.py)
`fedpers run --runtime flower` through the private SuperLink.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpers import config as config_lib
from fedpers.app import JOB, OUT, RUN_CONFIG_DEFAULTS, from_run_config
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import experiment
from fedpers.runner import execute
from tests.flower_support import InProcessGrid, free_port

ROOT = Path(__file__).resolve().parents[1]
EXP = experiment("altmin")
SMALL = {"n_users": 240, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 2, "seed": 5}


def test_nothing_calls_flowers_deprecated_simulation_entry_points():
    """`flwr.simulation.run_simulation` (deprecated, warning on every call) and `start_simulation`
    (deprecated, its removal under way) are named nowhere in the shipped code or the benchmarks."""
    found = []
    for folder in ("fedpers", "clients", "server", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            found += [
                f"{path.relative_to(ROOT)}: {name}" for name in ("run_simulation", "start_simulation") if name in text
            ]
    assert not found, found


def _saved(options: RuntimeOptions) -> dict:
    """What `fedpers run` records in config.json (and hands the simulation's ServerApp as its job)."""
    from fedpers.runner import resolve

    return json.loads(json.dumps(resolve(EXP, config_lib.build(EXP.config_type, SMALL), options).saved))


def test_a_job_file_carries_the_whole_run_and_nothing_else_beside_out(tmp_path):
    opts = config_lib.build(
        RuntimeOptions, {"runtime": "flower", "nodes": 3, "client_cpus": 2.0, "ray_address": "127.0.0.1:1"}
    )
    job = tmp_path / "job.json"
    job.write_text(json.dumps(_saved(opts)))
    fused = {**RUN_CONFIG_DEFAULTS, JOB: str(job), OUT: str(tmp_path / "run")}  # what Flower hands the ServerApp
    got = from_run_config(fused)
    assert got.experiment.name == "altmin" and got.cfg == config_lib.build(EXP.config_type, SMALL)
    assert got.options == opts and got.out == tmp_path / "run"
    with pytest.raises(ValueError, match=r"job holds the whole run .*drop \['config', 'min-fraction'\]"):
        from_run_config({**fused, "min-fraction": 0.5, "config": "rounds=3"})
    job.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        from_run_config(fused)
    with pytest.raises(ValueError, match="job: cannot read"):
        from_run_config({**fused, JOB: str(tmp_path / "missing.json")})


def test_a_deployment_reads_no_job_file():
    from fedpers.deploy.serverside import confine_config_file

    with pytest.raises(ValueError, match="a deployment reads no job file"):
        confine_config_file({JOB: "/etc/anything.json"}, None)


def test_the_serverapp_flower_loads_runs_a_job_to_the_local_runtimes_run(tmp_path):
    """The ServerApp the simulation loads (`server/server_app.py`), on an in-process Grid of 3 nodes,
    given the job `fedpers run --runtime flower` hands it: the local runtime's U, ledger and config
    (bar the runtime options), and the config.json `fedpers run` itself would write."""
    from flwr.app import Context, RecordDict

    import server.server_app as server_app
    from fedpers.app import make_client_app

    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": 3})
    job = tmp_path / "job.json"
    job.write_text(json.dumps(_saved(opts)))
    context = Context(
        run_id=1,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config={**RUN_CONFIG_DEFAULTS, JOB: str(job), OUT: str(tmp_path / "flower")},
    )
    server_app.main(InProcessGrid(make_client_app(), 3), context)
    local = execute(EXP, config_lib.build(EXP.config_type, SMALL), out=tmp_path / "local", progress=False)
    U = np.load(tmp_path / "flower" / "final_state.npz")["U"]
    torch.testing.assert_close(torch.from_numpy(U), local["_state"]["U"], rtol=0, atol=1e-12)
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    written = json.loads((tmp_path / "flower" / "config.json").read_text())
    assert written == _saved(opts)
    assert {k: v for k, v in written.items() if k != "runtime"} == {
        k: v for k, v in json.loads((tmp_path / "local" / "config.json").read_text()).items() if k != "runtime"
    }


def test_the_servers_error_reaches_the_caller_as_its_own_kind():
    from fedpers.app import error_line, raise_logged_error
    from fedpers.runtime.driver import RoundFailed

    log = (
        "INFO: starting\n\x1b[91mERROR \x1b[0m:     "
        + error_line(ValueError("rounds must be in [1, 1000]; got 0"))
        + "\nmore\n"
    )
    with pytest.raises(ValueError, match=r"^rounds must be in \[1, 1000\]; got 0$"):
        raise_logged_error(log)
    with pytest.raises(RoundFailed, match="below min_fraction"):
        raise_logged_error(error_line(RoundFailed("round 1: 1 of 3 clients answered acceptably, below min_fraction")))
    with pytest.raises(RuntimeError, match="ServerApp failed: KeyError: 'U'"):
        raise_logged_error(error_line(KeyError("U")))
    raise_logged_error("no error here\n")  # nothing raised


def test_provenance_hides_a_task_token_and_names_the_command_that_launched_the_run(monkeypatch):
    from fedpers.results import provenance as prov

    argv = [
        "/venv/bin/flwr-simulation",
        "--runtime-api-address",
        "127.0.0.1:1",
        "--token",
        "s3cr3t",
        "--insecure",
        "--token=again",
    ]
    assert prov.command_line(argv) == [
        "flwr-simulation",
        "--runtime-api-address",
        "127.0.0.1:1",
        "--token",
        "<hidden>",
        "--insecure",
        "--token=<hidden>",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    assert "s3cr3t" not in json.dumps(prov.provenance())
    monkeypatch.setenv(
        prov.LAUNCHED_BY,
        json.dumps(
            {"command": ["fedpers", "run", "altmin", "--runtime", "flower"], "git": {"commit": "abc", "dirty": False}}
        ),
    )
    record = prov.provenance()
    assert record["command"] == ["fedpers", "run", "altmin", "--runtime", "flower"] and record["git"] == {
        "commit": "abc",
        "dirty": False,
    }


def test_every_process_of_a_run_is_stopped_and_no_other(tmp_path):
    """A marked process, its child in a session of its own (out of reach of a process-group kill) and a
    grandchild that ignores SIGTERM all end; an unmarked process is left alone."""
    from fedpers.runtime.flower import managed

    marker = uuid.uuid4().hex
    ready = tmp_path / "ready"
    stubborn = f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); pathlib.Path({str(ready)!r}).touch(); time.sleep(120)"
    middle = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {stubborn!r}]); time.sleep(120)"
    tree = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {middle!r}], start_new_session=True); time.sleep(120)"
    marked = subprocess.Popen([sys.executable, "-c", tree], env={**os.environ, managed.MARKER: marker})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        deadline = time.monotonic() + 60
        while len(managed.marked_processes(marker)) < 3 or not ready.exists():
            assert time.monotonic() < deadline, managed.marked_processes(marker)
            time.sleep(0.1)
        killed = managed.stop_marked(marker, [marked], grace=3.0)
        assert len(killed) == 1  # the one ignoring SIGTERM needed SIGKILL
        time.sleep(0.5)
        assert managed.marked_processes(marker) == [] and marked.poll() is not None and other.poll() is None
    finally:
        other.kill()
        other.wait()
        managed.stop_marked(marker, [marked], grace=1.0)


def test_the_staged_app_is_a_flower_app_of_this_fedpers_and_its_registered_algorithms(tmp_path):
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import get_project_config

    from fedpers.app import COMPONENTS, app_entries, stage_app

    entries = {"toymean": ("tests.toy_algorithm", "ToyMean", "a toy")}
    app = stage_app(tmp_path / "app", entries)
    for name in ("fedpers/app.py", "clients/client_app.py", "server/server_app.py", "tests/toy_algorithm.py"):
        assert (app / name).read_bytes() == (ROOT / name).read_bytes(), name
    assert not list(app.rglob("__pycache__"))
    project = get_project_config(app)
    assert project["tool"]["flwr"]["app"]["components"] == COMPONENTS
    repo = get_project_config(ROOT)["tool"]["flwr"]["app"]
    assert project["tool"]["flwr"]["app"]["config"] == repo["config"] == RUN_CONFIG_DEFAULTS
    assert app_entries(app) == entries and app_entries(ROOT) == {}
    assert len(build_fab_from_disk(app)) > 0  # Flower accepts it as an app


def test_progress_is_read_from_the_run_directory_as_the_simulation_writes_it(tmp_path, capfd):
    from fedpers.runtime.flower.managed import RoundFollower

    run = tmp_path / "run"
    run.mkdir()
    follow = RoundFollower(
        run, rounds=3, desc="altmin", nodes=4, final="altmin: evaluating the private result", enabled=True
    )
    follow()
    (run / "config.json").write_text("{}")
    follow()
    for r in range(3):
        with open(run / "rounds.jsonl", "a") as f:
            f.write(json.dumps({"round": r}) + "\n")
        follow()
    (run / "result.json").write_text("{}")
    follow()
    assert (follow.seen, follow.stage, follow.bar.n) == (3, "done", 3)  # the round bar reached the last round
    follow.close()
    err = capfd.readouterr().err
    order = [
        "flower: starting the simulation",
        "flower: waiting for 4 nodes to join",
        "altmin: evaluating the private result …",
    ]
    at = [err.find(line) for line in order]
    assert -1 not in at and at == sorted(at), err


@pytest.mark.slow  # Flower's own CLI and managed SuperLink, a Ray simulation (~2 min on a busy machine)
def test_flwr_run_from_a_fresh_clone_equals_fedpers_run(tmp_path):
    """`git clone` of this repository, then `flwr run . local --run-config ...` as a Flower user types it
    (Flower's managed local SuperLink, told not to install dependencies; its ports moved off Flower's
    fixed ones so parallel runs cannot meet): the run directory it writes holds the local runtime's U
    for the same config and seed, and `fedpers report` opens it. Flower leaves its managed SuperLink
    running by design: stopped here as docs/flower.md says."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    home = tmp_path / "flwr-home"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "RAY_ADDRESS": "local",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    fields = " ".join(f"{k}={v}" for k, v in SMALL.items())
    out = tmp_path / "run"
    cmd = [
        str(Path(sys.executable).parent / "flwr"),
        "run",
        ".",
        "local",
        "--stream",
        "--run-config",
        f"config='{fields}' out='{out}' secure-noise=false",
        "--federation-config",
        "num-supernodes=3 client-resources-num-cpus=1",
    ]
    try:
        done = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        assert "uv sync" not in done.stdout + done.stderr  # no dependency installation
        assert "DEPRECATED" not in done.stdout + done.stderr  # Flower's supported path: no deprecation notice
        assert (out / "result.json").is_file(), (done.stdout + done.stderr)[-4000:]
    finally:
        _stop_flowers_local_superlink(home)
    local = execute(EXP, config_lib.build(EXP.config_type, SMALL), out=tmp_path / "local", progress=False)
    U = torch.from_numpy(np.load(out / "final_state.npz")["U"])
    torch.testing.assert_close(U, local["_state"]["U"], rtol=0, atol=1e-10)
    assert (out / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    report = subprocess.run(
        [sys.executable, "-m", "fedpers", "report", str(out)], capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr[-2000:]
    page = Path(report.stdout.strip().splitlines()[-1])
    assert page.is_file() and "altmin" in page.read_text()


def _stop_flowers_local_superlink(home: Path) -> None:
    """Flower's managed SuperLink (and its SuperExec) outlive `flwr run` by design: end every process
    whose environment names this test's FLWR_HOME (SIGTERM, then SIGKILL), and check none is left."""
    from fedpers.runtime.flower import managed

    needle = f"FLWR_HOME={home}".encode()

    def mine() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if needle in f.read().split(b"\0"):
                            found.append(int(entry))
                except OSError:
                    continue
        return [pid for pid in found if managed._alive(pid)]

    import signal

    for pid in mine():
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while mine() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in mine():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    assert not mine()
    shutil.rmtree(home, ignore_errors=True)
