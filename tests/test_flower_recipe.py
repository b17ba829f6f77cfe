"""The secure recipe exactly as `fedpers deploy certs` writes it in commands.txt, started
on 127.0.0.1, then attacked. Each attack is its own test on one federation (module fixture, tests
run in file order: the federation's budget ledger carries over, as on a real deployment).

The only changes to commands.txt's lines: `fedpers` runs as `python -m fedpers` of this checkout,
the job step's placeholder for the lab's checkout is this checkout and its example run-config is
replaced by each test's. Every machine's commands run, as the
recipe says, from the directory holding its directory (here the certs directory itself: its paths
are all relative). Loopback only: the proxy listens on
127.0.0.1 (`--listen`), standing in for the network address.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpers import config as config_lib
from fedpers.data.files import save_altmin_npz
from fedpers.deploy.recipe import CHECKOUT, steps
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import truth
from tests.flower_support import Processes, can_switch_uid, free_port, wait_for_log

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
EXP = EXPERIMENTS["altmin"]
FIELDS = {"n_users": 150, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 1, "seed": 11}
POLICY = 'federation = "lab"\nmax-epsilon = 8.0\nmax-delta = 1e-4\nrequire-secure-noise = true\nmin-units = 50\nalgorithms = ["altmin"]\n'


def _argv(command: str) -> tuple[dict[str, str], list[str]]:
    """A commands.txt line → (its VAR=value prefix, argv), `fedpers` as this checkout's python -m fedpers."""
    tokens = shlex.split(command)
    env = {}
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
        k, _, v = tokens.pop(0).partition("=")
        env[k] = v
    if tokens[0] == "fedpers":
        tokens = [sys.executable, "-m", "fedpers", *tokens[1:]]
    return env, tokens


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"port {port} not open (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


class Recipe:
    def __init__(self, work: Path, procs: Processes) -> None:
        self.work, self.procs = work, procs
        self.port, self.link_port, self.node_port = free_port(), free_port(), free_port()
        self.data = work / "users.npz"
        cfg = config_lib.build(EXP.config_type, FIELDS)
        users = EXP.units(cfg, torch.arange(FIELDS["n_users"]))
        save_altmin_npz(self.data, x=users["x"], y=users["y"], u_star=truth(cfg))
        (work / "policy.toml").write_text(POLICY)
        self.certs = work / "certs"
        made = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedpers",
                "deploy",
                "certs",
                str(self.certs),
                "--host",
                "127.0.0.1",
                "--supernodes",
                "3",
                "--port",
                str(self.port),
                "--link-port",
                str(self.link_port),
                "--node-port",
                str(self.node_port),
                "--listen",
                "127.0.0.1",
                "--data-file",
                str(self.data),
                "--app",
                str(ROOT),
                "--policy",
                str(work / "policy.toml"),
            ],
            cwd=ROOT,
            env=procs.env,
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert made.returncode == 0, made.stdout + made.stderr
        self.steps = steps((self.certs / "commands.txt").read_text())
        self.link = self.certs / "superlink"
        self.node_ids: list[int] = []
        self.node_procs: dict[int, tuple[list[str], dict[str, str]]] = {}

    def start(self) -> None:
        superlink = [c for m, c in self.steps if m == "superlink"]
        for name, command in zip(("superlink", "superexec", "fleet-proxy"), superlink[:3]):
            env, argv = _argv(command)
            proc, log = self.procs.start(name, argv, cwd=self.certs, **env)
            if name != "superexec":
                _wait_port(self.link_port if name == "superlink" else self.port, proc, log)
        for command in superlink[3:-1]:  # flwr's connection, then flwr supernode register, one per node
            env, argv = _argv(command)
            done = subprocess.run(
                argv,
                cwd=self.certs,
                env={**self.procs.env, **env},
                check=False,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if "connection" in argv:
                assert done.returncode == 0 and "flwr/config.toml" in done.stdout, done.stdout + done.stderr
                continue
            assert done.returncode == 0 and "registered successfully" in done.stdout, done.stdout + done.stderr
            self.node_ids.append(int(re.search(r"(\d{6,})", done.stdout).group(1)))
        started = []
        for machine, command in self.steps:
            if machine.startswith("supernode-"):
                env, argv = _argv(command)
                i = int(machine.split("-")[1])
                self.node_procs[i] = (argv, env)
                started.append(self.procs.start(machine, argv, cwd=self.certs, **env))
        for proc, log in started:  # each node re-executed isolated, its SuperExec and fork server up
            wait_for_log(log, "fork server ready", proc, timeout=300)
        self.job_env, self.job_argv = _argv(superlink[-1])
        self.job_argv[self.job_argv.index(CHECKOUT)] = str(ROOT)  # the lab's checkout on this machine

    def run(self, run_config: str, timeout: float = 400) -> subprocess.CompletedProcess:
        """Step 8 as written, with this run-config (node-partitions from the registrations)."""
        argv = list(self.job_argv)
        i = argv.index("--run-config")
        parts = " ".join(f"{node}={p}" for p, node in enumerate(self.node_ids))
        argv[i + 1] = f"{run_config} node-partitions='{parts}'"
        return subprocess.run(
            [*argv, "--timeout", str(timeout)],
            cwd=self.certs,
            env={**self.procs.env, **self.job_env},
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout + 120,
        )

    def attacker_home(self) -> Path:
        """What an intruder holds: the public ca.crt and the network address."""
        home = self.work / "intruder"
        home.mkdir(exist_ok=True)
        shutil.copy(self.certs / "superlink" / "ca.crt", home / "ca.crt")
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "lab"\n\n[superlink.lab]\naddress = "127.0.0.1:{self.port}"\nroot-certificates = "{home / "ca.crt"}"\n'
        )
        return home

    def set_policy(self, where: str, text: str) -> None:
        (self.certs / where / "policy.toml").write_text(text)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipe")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_DISABLE_UPDATE_CHECK": "1"}
    with Processes(work, env) as procs:
        r = Recipe(work, procs)
        r.start()
        yield r


def run_config(out: Path, **extra: str) -> str:
    """The job's run-config: the public shapes declared, no data path (the SuperLink side holds no user data)."""
    fields = {**FIELDS, "cohorts": '"all"'}
    fields.update(extra)
    pairs = " ".join(f"{k}={v}" for k, v in fields.items())
    return f"config='{pairs}' out='{out}' round-timeout=120.0"


def honest(recipe: Recipe, out: Path, **extra: str) -> str:
    return run_config(out, **extra)


def test_honest_run_completes_with_the_local_result(recipe):
    """The lab's run (the lab's policy here allows seeded noise, so the result can be compared exactly)."""
    from fedpers.runner import execute

    recipe.set_policy("superlink", POLICY.replace("require-secure-noise = true", "require-secure-noise = false"))
    try:
        out = recipe.work / "runs" / "honest"
        done = recipe.run(honest(recipe, out) + " secure-noise=false")
    finally:
        recipe.set_policy("superlink", POLICY)
    assert done.returncode == 0 and "finished:completed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    # the SuperLink side never had the users' file: not in the job, not in its directory; it evaluated nothing
    assert str(recipe.data) not in honest(recipe, out) and not any(p.suffix == ".npz" for p in recipe.link.rglob("*"))
    result = json.loads((out / "result.json").read_text())
    assert "unavailable" in result["evaluation"] and "subspace_error" not in result
    assert stat.S_IMODE(out.stat().st_mode) == 0o700 and all(
        stat.S_IMODE(p.stat().st_mode) == 0o600 for p in out.iterdir() if p.is_file()
    )
    cfg = config_lib.build(
        EXP.config_type, {"data": str(recipe.data), "rank": 2, "rounds": 1, "seed": 11, "cohorts": "all"}
    )
    local = execute(EXP, cfg, out=out.parent / "local", progress=False)
    U = torch.from_numpy(np.load(out / "final_state.npz")["U"])
    torch.testing.assert_close(U, local["_state"]["U"], rtol=0, atol=1e-5)
    ledger = json.loads((recipe.link / "lab-budget.json").read_text())
    assert [(c["epsilon"], c["units"]) for c in ledger["charges"]] == [(4.0, [0, 150])]
    assert "started through fedpers.deploy.appguard" in (recipe.work / "superexec.log").read_text()
    print("RUNLOG", done.stdout[-6000:])
    for i in range(3):  # the node cache of raw user data: 0700, files 0600
        cache = recipe.certs / f"supernode-{i}" / "cache"
        assert oct(cache.stat().st_mode & 0o777) == "0o700" and list(cache.iterdir())
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in cache.iterdir())


def test_an_existing_out_directory_is_refused_before_the_charge(recipe):
    """out= a directory that already holds a run: refused by the ServerApp before the budget ledger is touched."""
    out = recipe.work / "runs" / "reused"
    first = recipe.run(honest(recipe, out, epsilon="0.25"))
    assert "finished:completed" in first.stdout, first.stdout[-3000:]
    before = (recipe.link / "lab-budget.json").read_text()
    done = recipe.run(honest(recipe, out, epsilon="0.25"), timeout=200)
    assert done.returncode != 0 and "already holds a run" in done.stdout, done.stdout[-3000:]
    assert (recipe.link / "lab-budget.json").read_text() == before


def test_no_process_on_the_superlink_side_shows_a_task_token(recipe):
    """While a run goes on, every process the lab's SuperExec started is polled through /proc (what a
    neighbour process sees): the ServerApp runs (its guard's command line says its token came on a pipe)
    and no command line holds a task token. Every process of the SuperExec and of SuperNode 0 (the
    SuperExec, the fork server, its forks, the ServerApp) runs as `python -I`, with no PYTHON* variable and
    with Flower's telemetry off in its environment."""
    import threading

    from fedpers.deploy.appguard import TOKEN_STDIN
    from tests.flower_support import descendants

    superexec = next(p for p in recipe.procs.procs if list(p.args[3:5]) == ["deploy", "superexec"])
    node = next(p for p in recipe.procs.procs if list(p.args[3:5]) == ["deploy", "supernode"])
    seen: list[str] = []
    environments: dict[str, list[str]] = {}
    done_flag = threading.Event()

    def watch() -> None:
        while not done_flag.is_set():
            for pid in [superexec.pid, node.pid, *descendants(superexec.pid), *descendants(node.pid)]:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                except OSError:
                    continue
                seen.append(cmdline)
                environments[cmdline] = environ
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done = recipe.run(honest(recipe, recipe.work / "runs" / "watched", epsilon="0.25"))
    finally:
        done_flag.set()
        watcher.join()
    assert "finished:completed" in done.stdout, done.stdout[-3000:]
    assert any(TOKEN_STDIN in c for c in seen), sorted(set(seen))[:10]
    assert not any("--token " in c for c in seen), [c for c in seen if "--token " in c][:3]
    assert any("fedpers.deploy.appguard" in c for c in environments) and any("-I -c" in c for c in environments), list(
        environments
    )
    for cmdline, environ in environments.items():  # the ServerApp, the fork server and its forks among them
        assert "python" not in cmdline.split()[0] or cmdline.split()[1] == "-I", cmdline
        assert "FLWR_TELEMETRY_ENABLED=0" in environ and not [v for v in environ if v.startswith("PYTHON")], (
            cmdline,
            environ,
        )


def test_control_api_is_not_on_the_network_address(recipe):
    """flwr ls / log / run / supernode register / unregister / ls with the public ca.crt against the
    network address: all refused (404 from the Fleet-only proxy); the SuperLink listens on 127.0.0.1 only."""
    home = recipe.attacker_home()
    env = {**recipe.procs.env, "FLWR_HOME": str(home)}
    flwr = shutil.which("flwr") or "flwr"
    key = recipe.work / "intruder" / "own.pub"
    shutil.copy(recipe.link / "supernode-0.pub", key)
    attempts = {
        "ls": [flwr, "ls", "lab"],
        "log": [flwr, "log", "1", "lab"],
        "run": [flwr, "run", str(ROOT), "lab"],
        "register": [flwr, "supernode", "register", str(key), "lab"],
        "unregister": [flwr, "supernode", "unregister", str(recipe.node_ids[2]), "lab"],
        "supernode ls": [flwr, "supernode", "ls", "lab"],
    }
    for name, argv in attempts.items():
        done = subprocess.run(argv, cwd=home, env=env, check=False, capture_output=True, text=True, timeout=120)
        text = done.stdout + done.stderr
        assert done.returncode != 0 or "404" in text or "rror" in text, f"{name}: {text[-2000:]}"
        assert "registered successfully" not in text and "unregistered successfully" not in text.lower()
    listening = {
        line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:] if line.split()[3] == "0A"
    }
    assert f"0100007F:{recipe.link_port:04X}" in listening and f"00000000:{recipe.link_port:04X}" not in listening
    lab = subprocess.run(
        [flwr, "supernode", "ls", "deployment", "--format", "json"],
        cwd=recipe.certs,
        env={**recipe.procs.env, **recipe.job_env},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    for node in recipe.node_ids:  # the lab's nodes are all still registered
        assert str(node) in lab.stdout, lab.stdout + lab.stderr


NOBODY = 65534
needs_root = pytest.mark.skipif(
    not can_switch_uid(NOBODY), reason="this process cannot switch to another uid (the tests run as root in CI)"
)


def _control_calls(port: int, ca: bytes, run_id: int, node_id: int, key: bytes) -> dict[str, str]:
    """Each Control API call `flwr ls`, `flwr stop`, `flwr supernode ls/unregister/register` makes, through
    Flower's own client with the public CA certificate: what came back ("answered ..." or "refused: ERROR")."""
    from flwr.proto.control_pb2 import (
        ListNodesRequest,
        ListRunsRequest,
        RegisterNodeRequest,
        StopRunRequest,
        UnregisterNodeRequest,
    )
    from flwr.supercore.control.control_http_client import ControlHttpClient

    client = ControlHttpClient.from_server_address(
        f"127.0.0.1:{port}", insecure=False, root_certificates=ca, interceptors=[]
    )
    calls = {
        "ls": lambda: client.ListRuns(ListRunsRequest()),
        "stop": lambda: client.StopRun(StopRunRequest(run_id=run_id)),
        "supernode ls": lambda: client.ListNodes(ListNodesRequest()),
        "unregister": lambda: client.UnregisterNode(UnregisterNodeRequest(node_id=node_id)),
        "register": lambda: client.RegisterNode(RegisterNodeRequest(public_key=key)),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = f"answered {str(call())[:120]!r}"
        except Exception as e:
            out[name] = f"refused: {type(e).__name__}: {str(e)[:120]}"
    return out


def _as_uid(uid: int, work: object) -> dict[str, str]:
    """``work()`` in a forked child running as ``uid`` (no groups), its answer back as JSON on a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, json.dumps(work()).encode())  # type: ignore[operator]
        except BaseException as e:
            os.write(write, json.dumps({"child": f"{type(e).__name__}: {e}"}).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        got = r.read()
    os.waitpid(pid, 0)
    return json.loads(got)


@needs_root
def test_the_control_api_answers_only_the_labs_uid(recipe):
    """As uid `nobody` with the public ca.crt, on the SuperLink machine: list runs, stop the latest run, list
    nodes, unregister node 2 and register a key are each cut before the request is read (`fedpers deploy
    superlink` checks the connecting socket's owner); the lab's uid still lists every run and node, and
    nothing changed."""
    ca = (recipe.link / "ca.crt").read_bytes()
    key = (recipe.link / "supernode-0.pub").read_bytes()
    lab = _control_calls(recipe.link_port, ca, 0, 0, b"")
    assert lab["ls"].startswith("answered") and lab["supernode ls"].startswith("answered"), lab
    from flwr.proto.control_pb2 import ListRunsRequest
    from flwr.supercore.control.control_http_client import ControlHttpClient

    client = ControlHttpClient.from_server_address(
        f"127.0.0.1:{recipe.link_port}", insecure=False, root_certificates=ca, interceptors=[]
    )
    runs = client.ListRuns(ListRunsRequest()).run_dict
    latest = max(runs, key=lambda r: runs[r].pending_at)
    before = {r: runs[r].status.status + runs[r].status.sub_status for r in runs}
    other = _as_uid(NOBODY, lambda: _control_calls(recipe.link_port, ca, latest, recipe.node_ids[2], key))
    print("NOBODY", other)
    assert set(other) == {"ls", "stop", "supernode ls", "unregister", "register"}, other
    cut = ("RemoteProtocolError", "ReadError", "WriteError", "ConnectError")  # the connection cut, no HTTP answer
    assert all(v.startswith("refused") and any(e in v for e in cut) for v in other.values()), other
    after = client.ListRuns(ListRunsRequest()).run_dict
    assert {r: after[r].status.status + after[r].status.sub_status for r in before} == before  # nothing stopped
    listed = subprocess.run(
        [shutil.which("flwr") or "flwr", "supernode", "ls", "deployment", "--format", "json"],
        cwd=recipe.certs,
        env={**recipe.procs.env, **recipe.job_env},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    for node in recipe.node_ids:  # none unregistered
        assert str(node) in listed.stdout, listed.stdout + listed.stderr
    assert "refused a connection from uid 65534" in (recipe.work / "superlink.log").read_text()


def test_foreign_app_serverapp_never_executes(recipe):
    """Even submitted through the lab's own loopback connection, a foreign app's ServerApp is
    refused by the SuperLink's SuperExec (--trust-app): the marker it would write is absent."""
    app = recipe.work / "foreign"
    (app / "foreign").mkdir(parents=True)
    marker = recipe.work / "foreign-ran"
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n[project]\nname = "foreign"\nversion = "1.0.0"\n'
        'dependencies = []\n\n[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n[tool.flwr.app]\npublisher = "intruder"\n\n'
        '[tool.flwr.app.components]\nserverapp = "foreign.app:server"\nclientapp = "foreign.app:client"\n\n[tool.flwr.app.config]\n'
    )
    (app / "foreign" / "__init__.py").write_text("")
    (app / "foreign" / "app.py").write_text(
        "from pathlib import Path\nfrom flwr.clientapp import ClientApp\nfrom flwr.serverapp import ServerApp\n"
        f"server = ServerApp()\nclient = ClientApp()\n\n@server.main()\ndef main(grid, context):\n    Path({str(marker)!r}).write_text(open({str(recipe.link / 'superlink.key')!r}).read())\n"
    )
    argv = list(recipe.job_argv)
    argv[argv.index("--run-config") : argv.index("--run-config") + 2] = []
    done = subprocess.run(
        [*argv, "--app", str(app), "--timeout", "120"],
        cwd=recipe.certs,
        env={**recipe.procs.env, **recipe.job_env},
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "finished:completed" not in done.stdout, done.stdout[-3000:]
    time.sleep(3)
    assert not marker.exists()
    print("FOREIGN", done.stdout[-3000:], (recipe.work / "superexec.log").read_text()[-3000:])
    assert (
        "refused ServerApp" in (recipe.work / "superexec.log").read_text() + done.stdout
        and "finished:failed" in done.stdout
    )


def test_rogue_superexec_without_the_secret_gets_no_run(recipe):
    """A flower-superexec without the shared secret, polling the loopback Runtime API (and one
    polling the network address): the lab's next run is executed by the lab's SuperExec only."""
    ca = str(recipe.link / "ca.crt")
    rogue, rogue_log = recipe.procs.start(
        "rogue-superexec",
        ["flower-superexec", "--runtime-api-address", f"127.0.0.1:{recipe.link_port}", "--root-certificates", ca],
    )
    remote, remote_log = recipe.procs.start(
        "rogue-remote",
        ["flower-superexec", "--runtime-api-address", f"127.0.0.1:{recipe.port}", "--root-certificates", ca],
    )
    time.sleep(3)
    before = (recipe.work / "superexec.log").read_text().count("started through fedpers.deploy.appguard")
    done = recipe.run(honest(recipe, recipe.work / "runs" / "second", epsilon="2.0"))
    assert done.returncode == 0 and "finished:completed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert (recipe.work / "superexec.log").read_text().count(
        "started through fedpers.deploy.appguard"
    ) == before + 1  # the lab's SuperExec ran it
    for proc, log in ((rogue, rogue_log), (remote, remote_log)):
        text = log.read_text()
        assert "flwr-serverapp" not in text and "Launch" not in text, text[-2000:]
        proc.terminate()


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        ({"epsilon": "inf"}, "max-epsilon"),
        ({"__run": "secure-noise=false"}, "require-secure-noise"),
    ],
)
def test_run_configs_outside_the_policy_are_refused_by_the_serverapp(recipe, extra, rule):
    before = (recipe.link / "lab-budget.json").read_text()
    extra = dict(extra)
    tail = " " + extra.pop("__run", "")
    done = recipe.run(honest(recipe, recipe.work / "runs" / f"refused-{rule}", **extra) + tail, timeout=200)
    assert done.returncode != 0 and f"rule '{rule}'" in done.stdout, done.stdout[-3000:]
    assert (recipe.link / "lab-budget.json").read_text() == before  # nothing charged


def test_a_run_beyond_the_federations_budget_is_refused_before_any_release(recipe):
    """Users 0..149 have spent (after the earlier tests) 6.5 of the lab's 8; a run of epsilon=4 is
    refused by the budget ledger before discovery, and nothing is charged. (Run alone, the test
    first spends the budget with a run of its own.)"""
    from fedpers.runtime.flower.policy import BudgetLedger

    ledger = BudgetLedger(recipe.link / "lab-budget.json", "lab")
    spent = ledger.spent((0, 150))[0]
    if spent + 4.0 <= 8.0:
        first = recipe.run(honest(recipe, recipe.work / "runs" / "spend", epsilon=str(8.0 - spent - 2.0)))
        assert "finished:completed" in first.stdout, first.stdout[-3000:]
    before = (recipe.link / "lab-budget.json").read_text()
    out = recipe.work / "runs" / "over-budget"
    done = recipe.run(honest(recipe, out, epsilon="4.0"), timeout=200)
    spent = ledger.spent((0, 150))[0]
    assert (
        done.returncode != 0 and "rule 'max-epsilon'" in done.stdout and f"have spent epsilon={spent:g}" in done.stdout
    ), done.stdout[-3000:]
    assert (recipe.link / "lab-budget.json").read_text() == before  # nothing charged
    assert not (out / "rounds.jsonl").exists()  # no round, no release


def test_algorithm_outside_the_policy_is_refused(recipe):
    argv_config = f"algorithm='dpals' config='n_users=60 n_items=40 rank=2' out='{recipe.work / 'runs' / 'dpals'}' round-timeout=60.0"
    done = recipe.run(argv_config, timeout=200)
    assert done.returncode != 0 and "rule 'algorithms'" in done.stdout, done.stdout[-3000:]


def test_nodes_refuse_a_task_below_min_units_even_if_the_serverapp_allows_it(recipe):
    """The SuperLink's policy loosened to min-units=1 (a careless or compromised curator); 150 users
    on 3 nodes in 2 disjoint cohorts: each node's range holds 50 users but a round's message would
    cover about 25: every node refuses before computing, naming the rule; the run does not complete."""
    recipe.set_policy("superlink", POLICY.replace("min-units = 50", "min-units = 1"))
    try:
        done = recipe.run(
            honest(recipe, recipe.work / "runs" / "small", epsilon="0.5", cohorts='"disjoint"', rounds="2"), timeout=200
        )
    finally:
        recipe.set_policy("superlink", POLICY)
    assert done.returncode != 0 and "finished:completed" not in done.stdout, done.stdout[-3000:]
    for i in range(3):
        assert "rule 'min-units'" in (recipe.work / f"supernode-{i}.log").read_text()


def _restart_node(
    recipe: Recipe, i: int, name: str, argv: list[str] | None = None, **env: str
) -> tuple[subprocess.Popen, Path]:
    """SuperNode ``i`` stopped (with its SuperExec and forks) and started again as ``name``: its commands.txt
    line, ``argv`` in place of its interpreter and module if given, ``env`` added."""
    from tests.flower_support import stop_processes

    line, line_env = recipe.node_procs[i]
    running = [p for p in recipe.procs.procs if p.args[3:] == line[3:] and p.poll() is None]
    stop_processes(running)
    return recipe.procs.start(name, [*(argv or line[:3]), *line[3:]], cwd=recipe.certs, **{**line_env, **env})


def _accepted(out: Path) -> list[int]:
    return [json.loads(line)["clients_accepted"] for line in (out / "rounds.jsonl").read_text().splitlines()]


def _rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB: its resident memory now and at its peak."""
    fields = {
        line.split(":")[0]: line.split()[1]
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith(("VmRSS", "VmHWM"))
    }
    return int(fields["VmRSS"]) / 1024, int(fields["VmHWM"]) / 1024


PROXY_RSS_MIB = 256
"""The fleet proxy's stated memory bound (docs/flower.md): its buffers (fleetproxy.Limits.bound()) and the interpreter."""


def test_an_honest_run_completes_beside_520_slow_body_connections(recipe):
    """520 connections from 65 loopback addresses each send a 6 MiB request's headers (every other one 5 MiB of
    its body at once: what the proxy must buffer) and then 100 bytes a second, reconnecting as soon as they are cut; SuperNode 1 is restarted in the middle of it (it needs new
    connections through the full proxy). The lab's run completes with all three nodes accepted in every
    round, and the proxy's resident memory (sampled, and its peak) stays under its stated bound."""
    import threading

    proxy = next(p for p in recipe.procs.procs if "fleet-proxy" in p.args)
    report = recipe.work / "slow-bodies.json"
    attack, _ = recipe.procs.start(
        "slow-bodies",
        [
            sys.executable,
            str(ROOT / "tests" / "slow_bodies.py"),
            str(recipe.port),
            str(recipe.link / "ca.crt"),
            "520",
            "900",
            str(report),
            str(5 << 20),
        ],
    )
    samples: list[float] = []
    done_flag = threading.Event()

    def sample() -> None:
        while not done_flag.is_set():
            samples.append(_rss_mib(proxy.pid)[0])
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        deadline = time.monotonic() + 300  # a loaded 2-core machine opens 520 TLS connections twice in well under this
        while not (
            report.is_file() and json.loads(report.read_text() or "{}").get("opened", 0) >= 1040
        ):  # each came twice
            assert attack.poll() is None and time.monotonic() < deadline, (
                report.read_text() if report.is_file() else "no report"
            )
            time.sleep(0.5)
        _, restarted = _restart_node(recipe, 1, "supernode-1-restarted")
        wait_for_log(
            restarted, "fork server ready", recipe.procs.procs[-1], timeout=300
        )  # the run starts once node 1 is back
        out = recipe.work / "runs" / "slow-bodies"
        done = recipe.run(honest(recipe, out, epsilon="0.05"))
        stats = json.loads(report.read_text())
    finally:
        done_flag.set()
        sampler.join()
        from tests.flower_support import stop_processes

        stop_processes([attack])
    peak = _rss_mib(proxy.pid)[1]
    print(
        f"SLOW-BODIES attack {stats}; proxy RSS max {max(samples):.1f} MiB, peak (VmHWM) {peak:.1f} MiB over {len(samples)} samples"
    )
    assert done.returncode == 0 and "finished:completed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert _accepted(out) == [3, 3], _accepted(out)
    assert stats["most_open"] >= 400 and stats["cut"] >= 1000, stats  # the attack held the slots, was cut and came back
    assert max(samples) < PROXY_RSS_MIB and peak < PROXY_RSS_MIB, (max(samples), peak)


SELF_ERASING = """import os, sys
with open({marker!r}, "a") as f:
    f.write(f"{{os.getpid()}} isolated={{sys.flags.isolated}} {{' '.join(sys.argv)}}\\n")
import types
sys.modules["sitecustomize"] = types.ModuleType("sitecustomize")  # erases itself: no file for a check that looks later
"""


def test_a_node_started_with_a_planted_environment_runs_only_the_installed_code(recipe):
    """SuperNode 2 restarted with a PYTHONPATH holding a self-erasing sitecustomize (it records each process it
    runs in, then replaces its sys.modules entry by an empty module, leaving no file for a check to find) and a
    modified fedpers first: `fedpers deploy supernode` re-executes itself as `python -I` without PYTHON*
    variables, so the planted code runs in no process that handles data — only in the shell's first
    interpreter, before the re-execution (without isolation PYTHONPATH would reach the SuperExec and the fork
    server, and each would record itself) — and the node answers with the installed code: the run completes
    with all three nodes."""
    planted = recipe.work / "planted"
    shutil.copytree(ROOT / "fedpers", planted / "fedpers", ignore=shutil.ignore_patterns("__pycache__"))
    client = planted / "fedpers" / "runtime" / "flower" / "client.py"
    client.write_text(client.read_text() + "\nraise RuntimeError('the planted fedpers was imported')\n")
    marker = recipe.work / "sitecustomize-ran.txt"
    (planted / "sitecustomize.py").write_text(SELF_ERASING.format(marker=str(marker)))
    _, log = _restart_node(recipe, 2, "supernode-2-planted", PYTHONPATH=str(planted))
    wait_for_log(log, "fork server ready", recipe.procs.procs[-1])
    out = recipe.work / "runs" / "planted"
    done = recipe.run(honest(recipe, out, epsilon="0.05"))
    assert done.returncode == 0 and "finished:completed" in done.stdout, done.stdout[-3000:]
    assert _accepted(out) == [3, 3], _accepted(out)
    ran = marker.read_text().splitlines()
    assert len(ran) == 1 and "isolated=0" in ran[0] and "deploy supernode" in ran[0], (
        ran
    )  # the shell's interpreter only
    text = log.read_text()
    isolated = next(line for line in text.splitlines() if "running isolated (python -I); ignoring" in line)
    assert (
        "PYTHONPATH" in isolated and "planted fedpers was imported" not in text and "Error in sitecustomize" not in text
    )


def _node_installation(recipe: Recipe, name: str) -> tuple[Path, Path]:
    """A Python environment of its own for a SuperNode: a venv whose fedpers is a copy (returned with the
    venv's python), everything else this environment's packages."""
    import sysconfig

    base = recipe.work / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=300)
    shutil.copytree(ROOT / "fedpers", base / "installed" / "fedpers", ignore=shutil.ignore_patterns("__pycache__"))
    python = base / "venv" / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "fedpers-node.pth").write_text(f"{base / 'installed'}\n{sysconfig.get_paths()['purelib']}\n")
    return python, base / "installed" / "fedpers"


def test_a_node_on_code_swapped_around_its_fork_servers_start_refuses(recipe):
    """SuperNode 2 with its own installation: client.py modified before its fork server starts and restored once
    the server is ready (the files on disk equal the FAB again). The fork server compiled the modified bytes;
    each fork compares what it compiled with the FAB and refuses (ModifiedCode), so the run goes on without
    node 2's releases (min-fraction 0.6) — the unpinned check compared the restored files and let it run."""
    python, installed = _node_installation(recipe, "node-2-install")
    client = installed / "runtime" / "flower" / "client.py"
    honest_code = client.read_text()
    client.write_text(honest_code + "\nLEAKED = True  # swapped in for the fork server's start\n")
    proc, log = _restart_node(recipe, 2, "supernode-2-swapped", [str(python), "-m", "fedpers"])
    wait_for_log(log, "fork server ready", proc)
    client.write_text(honest_code)  # restored: the disk is the FAB's again
    assert f"fedpers pinned at {installed}" in log.read_text()
    out = recipe.work / "runs" / "swapped"
    done = recipe.run(honest(recipe, out, epsilon="0.05") + " min-fraction=0.6")
    assert "finished:completed" in done.stdout, done.stdout[-3000:]
    assert _accepted(out) == [2, 2] and all(
        "partition-2" in json.loads(line)["dropped"] for line in (out / "rounds.jsonl").read_text().splitlines()
    )
    text = log.read_text()
    assert "ModifiedCode" in text and "runtime/flower/client.py" in text and "as read when it started" in text, text[
        -3000:
    ]


def test_a_stopped_run_sends_no_further_round_and_its_serverapp_exits(recipe):
    """`flwr stop` once round 0 is recorded: at most the round in flight is still recorded, and no
    ServerApp process of the lab's SuperExec is left. Last in the module: after a stop, Flower's
    SuperNode keeps the stopped run's in-flight ClientApp waiting, which delays that node's next task
    (seen: past a later run's 120 s round timeout). SuperNode 2 runs modified code by now (it refuses):
    min-fraction 0.6 lets the run go on with nodes 0 and 1."""
    from tests.flower_support import descendants

    out = recipe.work / "runs" / "stopped"
    argv = list(recipe.job_argv)
    i = argv.index("--run-config")
    parts = " ".join(f"{node}={p}" for p, node in enumerate(recipe.node_ids))
    argv[i + 1] = honest(recipe, out, epsilon="0.2", rounds="8") + f" min-fraction=0.6 node-partitions='{parts}'"
    env = {**recipe.procs.env, **recipe.job_env}
    job = subprocess.Popen(
        [*argv, "--timeout", "400"],
        cwd=recipe.certs,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_id = ""
        for line in job.stdout:  # type: ignore[union-attr]
            if line.startswith("started run "):
                run_id = line.split()[-1]
                break
        assert run_id
        deadline = time.monotonic() + 300
        while not (out / "rounds.jsonl").is_file() or not (out / "rounds.jsonl").read_text().strip():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.1)
        flwr = shutil.which("flwr") or "flwr"
        stopped = subprocess.run(
            [flwr, "stop", run_id, "deployment"], cwd=recipe.certs, env=env, capture_output=True, text=True, timeout=120
        )
        at_stop = len((out / "rounds.jsonl").read_text().splitlines())
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    time.sleep(5)
    rounds = len((out / "rounds.jsonl").read_text().splitlines())
    assert rounds <= at_stop + 1 and rounds < 9, (at_stop, rounds)
    superexec = next(p for p in recipe.procs.procs if list(p.args[3:5]) == ["deploy", "superexec"])
    left = []
    for pid in descendants(superexec.pid):
        try:
            if b"appguard" in Path(f"/proc/{pid}/cmdline").read_bytes():
                left.append(pid)
        except OSError:
            pass  # exited meanwhile
    assert left == [], left
