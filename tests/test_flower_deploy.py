"""`flwr run .` from the repo root against real Flower processes on 127.0.0.1 (insecure, free ports).

Deployment: one ``flower-superlink`` and three ``flower-supernode`` processes, each node
given its partition and a data file through ``--node-config``. Simulation: a
``flower-superlink --simulation``. Both must give the local runtime's result; every
process is stopped even when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpers import config as config_lib
from fedpers.data.files import save_altmin_npz
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import truth
from fedpers.runner import execute
from tests.flower_support import (
    Processes,
    free_port,
    start_loopback_federation,
    start_superlink,
    start_supernode,
    wait_for_log,
    write_connection,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
EXP = EXPERIMENTS["altmin"]
FIELDS = {"n_users": 150, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 1, "seed": 11}


def flwr_run(
    procs: Processes, home: Path, connection: str, run_config: str, *extra: str
) -> subprocess.CompletedProcess:
    cmd = [shutil.which("flwr") or "flwr", "run", ".", connection, "--stream", "--run-config", run_config, *extra]
    return subprocess.run(
        cmd, cwd=ROOT, env={**procs.env, "FLWR_HOME": str(home)}, capture_output=True, text=True, timeout=480
    )


def check_against_local(out: Path, cfg, done: subprocess.CompletedProcess, deployed: bool = True) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "result.json").is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    local = execute(EXP, cfg, out=out.parent / "local", progress=False)
    U = torch.from_numpy(np.load(out / "final_state.npz")["U"])
    torch.testing.assert_close(U, local["_state"]["U"], rtol=0, atol=1e-5)
    assert (out / "ledger.json").read_text() == (out.parent / "local" / "ledger.json").read_text()
    result = json.loads((out / "result.json").read_text())
    assert result["runtime"] == "flower"
    if deployed:  # the SuperLink side holds no user data: it evaluates nothing
        assert "unavailable" in result["evaluation"] and "subspace_error" not in result
    else:
        assert abs(result["subspace_error"] - local["subspace_error"]) < 1e-8


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_DISABLE_UPDATE_CHECK": "1"}


def test_deployment_superlink_three_supernodes_with_data_files(tmp_path, env):
    users = EXP.units(config_lib.build(EXP.config_type, FIELDS), torch.arange(FIELDS["n_users"]))
    data = tmp_path / "users.npz"
    save_altmin_npz(data, x=users["x"], y=users["y"], u_star=truth(config_lib.build(EXP.config_type, FIELDS)))
    cfg = config_lib.build(EXP.config_type, {"data": str(data), "rank": 2, "rounds": 1, "seed": 11})
    with Processes(tmp_path, env) as procs:
        port = start_superlink(procs, tmp_path)
        for i in range(3):
            node_data = tmp_path / f"node{i}.npz"
            shutil.copy(data, node_data)
            start_supernode(procs, tmp_path, port, i, 3, node_config=f"data-file='{node_data}'")
        home = tmp_path / "cli-home"
        write_connection(home, "deployment", f"127.0.0.1:{port}")
        out = tmp_path / "runs" / "flower"
        # the SuperLink side declares the shapes and opens no data file; each node reads its own copy
        done = flwr_run(
            procs,
            home,
            "deployment",
            f"config='n_users=150 dim=5 samples_per_user=8 rank=2 rounds=1 seed=11' out='{out}' round-timeout=300.0 secure-noise=false",
        )  # reproducible: compared with the local run
        check_against_local(out, cfg, done)


def test_simulation_superlink(tmp_path, env):
    cfg = config_lib.build(EXP.config_type, FIELDS)
    with Processes(tmp_path, env) as procs:
        port = start_superlink(procs, tmp_path, "--simulation")
        home = tmp_path / "cli-home"
        write_connection(home, "simulation", f"127.0.0.1:{port}")
        out = tmp_path / "runs" / "flower"
        pairs = " ".join(f"{k}={v}" for k, v in FIELDS.items())
        done = flwr_run(
            procs,
            home,
            "simulation",
            f"config='{pairs}' out='{out}' secure-noise=false",
            "--federation-config",
            "num-supernodes=3 client-resources-num-cpus=1",
        )
        check_against_local(out, cfg, done, deployed=False)


def test_tls_and_supernode_authentication_with_fedpers_deploy_certs(tmp_path, env):
    """The secure recipe end to end on 127.0.0.1: `fedpers deploy certs`, a TLS SuperLink with
    SuperNode authentication, two SuperNodes registered with `flwr supernode register`; an
    unregistered SuperNode and one without the lab's CA are refused while the run completes
    and equals the local runtime's."""
    import time

    from fedpers.deploy import make_certs

    certs = tmp_path / "certs"
    make_certs(certs, ["127.0.0.1"], 3)
    cfg = config_lib.build(EXP.config_type, FIELDS)
    port = free_port()
    with Processes(tmp_path, env) as procs:
        link, link_log = procs.start(
            "superlink",
            [
                "flower-superlink",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--ssl-ca-certfile",
                str(certs / "superlink" / "ca.crt"),
                "--ssl-certfile",
                str(certs / "superlink" / "superlink.crt"),
                "--ssl-keyfile",
                str(certs / "superlink" / "superlink.key"),
                "--enable-supernode-auth",
                "--disable-runtime-dependency-installation",
            ],
            FLWR_HOME=str(tmp_path / "link-home"),
        )
        wait_for_log(link_log, "Starting Flower SuperExec", link)
        home = tmp_path / "cli-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\naddress = "127.0.0.1:{port}"\nroot-certificates = "{certs / "superlink" / "ca.crt"}"\n'
        )
        flwr = shutil.which("flwr") or "flwr"
        for i in range(2):  # supernode-2's key is never registered
            reg = subprocess.run(
                [flwr, "supernode", "register", str(certs / "superlink" / f"supernode-{i}.pub"), "deployment"],
                env={**env, "FLWR_HOME": str(home)},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert reg.returncode == 0 and "registered successfully" in reg.stdout, reg.stdout + reg.stderr

        from fedpers.deploy.forkserver import app_hash

        ours = app_hash(str(ROOT))

        def supernode(name: str, key: str, partition: int, ca: bool = True):
            cmd = [
                sys.executable,
                "-m",
                "fedpers",
                "deploy",
                "supernode",
                "--trust-app",
                ours,
                "--superlink",
                f"127.0.0.1:{port}",
                "--port",
                str(free_port()),
                "--auth-supernode-private-key",
                str(certs / key.removesuffix(".key") / key),
                "--node-config",
                f"partition-id={partition} num-partitions=2",
            ]
            return procs.start(
                name,
                cmd + (["--root-certificates", str(certs / "supernode-0" / "ca.crt")] if ca else []),
                FLWR_HOME=str(tmp_path / f"{name}-home"),
            )

        supernode("node0", "supernode-0.key", 0)
        supernode("node1", "supernode-1.key", 1)
        intruder, intruder_log = supernode("unregistered", "supernode-2.key", 1)
        stranger, stranger_log = supernode("no-ca", "supernode-0.key", 0, ca=False)
        out = tmp_path / "runs" / "flower"
        done = flwr_run(
            procs,
            home,
            "deployment",
            f"config='n_users=150 dim=5 rank=2 samples_per_user=8 rounds=1 seed=11' out='{out}' round-timeout=300.0 secure-noise=false",
        )
        check_against_local(out, cfg, done)
        assert "forked a warm ClientApp" in (tmp_path / "node0.log").read_text()  # the recipe's fast path ran
        deadline = time.monotonic() + 60
        while (intruder.poll() is None or stranger.poll() is None) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert intruder.poll() not in (None, 0), intruder_log.read_text()[-2000:]
        assert "Failed to activate SuperNode" in intruder_log.read_text()
        assert stranger.poll() not in (None, 0) or "SuperNode ID" not in stranger_log.read_text(), (
            stranger_log.read_text()[-2000:]
        )


def test_a_supernode_killed_mid_run(tmp_path, env):
    """Three SuperNodes; the third is killed (SIGKILL, with its children) once round 0 is done.
    With min-fraction 0.6 the later rounds complete without it, and their records name it."""
    import signal
    import threading
    import time

    from tests.flower_support import descendants

    out = tmp_path / "runs" / "flower"
    with Processes(tmp_path, env) as procs:
        port = start_superlink(procs, tmp_path)
        nodes = [start_supernode(procs, tmp_path, port, i, 3) for i in range(3)]
        home = tmp_path / "cli-home"
        write_connection(home, "deployment", f"127.0.0.1:{port}")
        killed = threading.Event()

        def kill_after_round_0() -> None:
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                rounds = out / "rounds.jsonl"
                if rounds.is_file() and rounds.read_text().count("\n") >= 1:
                    for pid in [nodes[2].pid, *descendants(nodes[2].pid)]:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    killed.set()
                    return
                time.sleep(0.2)

        watcher = threading.Thread(target=kill_after_round_0, daemon=True)
        watcher.start()
        done = flwr_run(
            procs,
            home,
            "deployment",
            f"config='n_users=150 dim=5 rank=2 samples_per_user=8 rounds=2 cohorts=\"all\" seed=11' out='{out}' round-timeout=30.0 min-fraction=0.6 secure-noise=false",
        )
        assert killed.is_set() and done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        assert [r["clients_accepted"] for r in rounds] == [3, 2, 2]
        assert all("partition-2" in r["dropped"] for r in rounds[1:])
        assert json.loads((out / "result.json").read_text())["status"] == "completed"


def test_an_aborted_deployment_run_exits_non_zero_through_fedpers_deploy_run(tmp_path, env):
    """A ServerApp that refuses its config ends the run as finished:failed; `fedpers deploy run`
    exits 1 and says so (Flower 1.41's `flwr run --stream` exits 0 on the same run)."""
    with Processes(tmp_path, env) as procs:
        port = start_loopback_federation(procs, tmp_path, 1)
        home = tmp_path / "cli-home"
        write_connection(home, "deployment", f"127.0.0.1:{port}")
        bad = f"config='n_users=150 dim=5 rank=9 samples_per_user=8 rounds=1' out='{tmp_path / 'runs' / 'bad'}' round-timeout=60.0 secure-noise=false"
        done = subprocess.run(
            [sys.executable, "-m", "fedpers", "deploy", "run", "deployment", "--run-config", bad, "--timeout", "300"],
            cwd=ROOT,
            env={**procs.env, "FLWR_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
        assert "finished:failed" in done.stdout


def test_fedpers_superexec_with_process_isolation_gives_the_local_result(tmp_path, env):
    """One command per node, `fedpers deploy supernode` (0.2 s poll, Flower's default subprocess
    isolation), starts `fedpers deploy superexec` itself (warm forked ClientApps): the deployment
    result equals the local runtime's, and `fedpers deploy run` exits 0."""
    cfg = config_lib.build(EXP.config_type, FIELDS)
    with Processes(tmp_path, env) as procs:
        port = start_loopback_federation(procs, tmp_path, 2, warm=True, poll=0.2)
        home = tmp_path / "cli-home"
        write_connection(home, "deployment", f"127.0.0.1:{port}")
        out = tmp_path / "runs" / "flower"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedpers",
                "deploy",
                "run",
                "deployment",
                "--timeout",
                "400",
                "--run-config",
                f"config='n_users=150 dim=5 rank=2 samples_per_user=8 rounds=1 seed=11' out='{out}' round-timeout=300.0 secure-noise=false",
            ],
            cwd=ROOT,
            env={**procs.env, "FLWR_HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert "finished:completed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
        check_against_local(out, cfg, done)
        for i in range(2):  # discovery + 2 rounds: every ClientApp ran in a fork, none through flwr-clientapp
            assert (tmp_path / f"supernode{i}.log").read_text().count("forked a warm ClientApp") >= 3


def test_a_supernode_runs_only_trusted_apps(tmp_path, env):
    """Two `fedpers deploy supernode`s: node 0 trusts this app's FAB hash (`fedpers deploy app-hash`),
    node 1 trusts another app only. Node 1 refuses every ClientApp of this run before any of its code
    loads (an error reply, not a silent hang); the run completes with node 0 (min-fraction 0.5)."""
    from fedpers.deploy.forkserver import app_hash

    ours = app_hash(str(ROOT))
    out = tmp_path / "runs" / "flower"
    with Processes(tmp_path, env) as procs:
        port = start_superlink(procs, tmp_path)
        for i, trusted in enumerate([ours, "0" * 64]):
            launcher = [sys.executable, "-m", "fedpers", "deploy", "supernode", "--trust-app", trusted]
            start_supernode(procs, tmp_path, port, i, 2, launcher)
        home = tmp_path / "cli-home"
        write_connection(home, "deployment", f"127.0.0.1:{port}")
        done = flwr_run(
            procs,
            home,
            "deployment",
            f"config='n_users=150 dim=5 rank=2 samples_per_user=8 rounds=1 cohorts=\"all\" seed=11' out='{out}' round-timeout=60.0 min-fraction=0.5 secure-noise=false",
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        assert [r["clients_accepted"] for r in rounds] == [1, 1] and all("partition-1" in r["dropped"] for r in rounds)
        assert json.loads((out / "result.json").read_text())["status"] == "completed"
        refused = (tmp_path / "supernode1.log").read_text()
        assert f"FAB {ours} is not one of them" in refused and "UntrustedApp" in refused
        assert "forked a warm ClientApp" in (tmp_path / "supernode0.log").read_text()
