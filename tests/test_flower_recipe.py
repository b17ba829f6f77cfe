"""The secure recipe exactly as `fedpers deploy certs` writes it in commands.txt, started
on 127.0.0.1, then attacked. Each attack is its own test on one federation (module fixture, tests
run in file order: the federation's budget ledger carries over, as on a real deployment).

The only change to commands.txt's lines: `fedpers` runs as `python -m fedpers` of this checkout,
and step 8's example run-config is replaced by each test's. Loopback only: the proxy listens on
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
from fedpers.deploy.recipe import steps
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import truth
from tests.flower_support import Processes, free_port

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
        made = subprocess.run([sys.executable, "-m", "fedpers", "deploy", "certs", str(self.certs), "--host", "127.0.0.1", "--supernodes", "3",
                               "--port", str(self.port), "--link-port", str(self.link_port), "--node-port", str(self.node_port), "--listen", "127.0.0.1",
                               "--data-file", str(self.data), "--app", str(ROOT), "--policy", str(work / "policy.toml")],
                              cwd=ROOT, env=procs.env, check=False, capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stdout + made.stderr
        self.steps = steps((self.certs / "commands.txt").read_text())
        self.link = self.certs / "superlink"
        self.node_ids: list[int] = []
        self.node_procs: dict[int, tuple[list[str], dict[str, str]]] = {}

    def start(self) -> None:
        superlink = [c for m, c in self.steps if m == "superlink"]
        for name, command in zip(("superlink", "superexec", "fleet-proxy"), superlink[:3]):
            env, argv = _argv(command)
            proc, log = self.procs.start(name, argv, **env)
            if name != "superexec":
                _wait_port(self.link_port if name == "superlink" else self.port, proc, log)
        for command in superlink[3:-1]:  # flwr supernode register, one per node
            env, argv = _argv(command)
            done = subprocess.run(argv, cwd=ROOT, env={**self.procs.env, **env}, check=False, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and "registered successfully" in done.stdout, done.stdout + done.stderr
            self.node_ids.append(int(re.search(r"(\d{6,})", done.stdout).group(1)))
        for machine, command in self.steps:
            if machine.startswith("supernode-"):
                env, argv = _argv(command)
                i = int(machine.split("-")[1])
                self.node_procs[i] = (argv, env)
                self.procs.start(machine, argv, **env)
        self.job_env, self.job_argv = _argv(superlink[-1])

    def run(self, run_config: str, timeout: float = 400) -> subprocess.CompletedProcess:
        """Step 8 as written, with this run-config (node-partitions from the registrations)."""
        argv = list(self.job_argv)
        i = argv.index("--run-config")
        parts = " ".join(f"{node}={p}" for p, node in enumerate(self.node_ids))
        argv[i + 1] = f"{run_config} node-partitions='{parts}'"
        return subprocess.run([*argv, "--timeout", str(timeout)], cwd=ROOT, env={**self.procs.env, **self.job_env}, check=False, capture_output=True, text=True, timeout=timeout + 120)

    def attacker_home(self) -> Path:
        """What an intruder holds: the public ca.crt and the network address."""
        home = self.work / "intruder"
        home.mkdir(exist_ok=True)
        shutil.copy(self.certs / "superlink" / "ca.crt", home / "ca.crt")
        (home / "config.toml").write_text(f'[superlink]\ndefault = "lab"\n\n[superlink.lab]\naddress = "127.0.0.1:{self.port}"\nroot-certificates = "{home / "ca.crt"}"\n')
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
    assert stat.S_IMODE(out.stat().st_mode) == 0o700 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in out.iterdir() if p.is_file())
    cfg = config_lib.build(EXP.config_type, {"data": str(recipe.data), "rank": 2, "rounds": 1, "seed": 11, "cohorts": "all"})
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
    and no command line holds a task token."""
    import threading

    from fedpers.deploy.appguard import TOKEN_STDIN
    from tests.flower_support import descendants

    superexec = next(p for p in recipe.procs.procs if list(p.args[3:5]) == ["deploy", "superexec"])
    seen: list[str] = []
    done_flag = threading.Event()

    def watch() -> None:
        while not done_flag.is_set():
            for pid in descendants(superexec.pid):
                try:
                    seen.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
                except OSError:
                    pass
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


def test_control_api_is_not_on_the_network_address(recipe):
    """flwr ls / log / run / supernode register / unregister / ls with the public ca.crt against the
    network address: all refused (404 from the Fleet-only proxy); the SuperLink listens on 127.0.0.1 only."""
    home = recipe.attacker_home()
    env = {**recipe.procs.env, "FLWR_HOME": str(home)}
    flwr = shutil.which("flwr") or "flwr"
    key = recipe.work / "intruder" / "own.pub"
    shutil.copy(recipe.link / "supernode-0.pub", key)
    attempts = {
        "ls": [flwr, "ls", "lab"], "log": [flwr, "log", "1", "lab"], "run": [flwr, "run", str(ROOT), "lab"],
        "register": [flwr, "supernode", "register", str(key), "lab"], "unregister": [flwr, "supernode", "unregister", str(recipe.node_ids[2]), "lab"],
        "supernode ls": [flwr, "supernode", "ls", "lab"],
    }
    for name, argv in attempts.items():
        done = subprocess.run(argv, cwd=home, env=env, check=False, capture_output=True, text=True, timeout=120)
        text = done.stdout + done.stderr
        assert done.returncode != 0 or "404" in text or "rror" in text, f"{name}: {text[-2000:]}"
        assert "registered successfully" not in text and "unregistered successfully" not in text.lower()
    listening = {line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:] if line.split()[3] == "0A"}
    assert f"0100007F:{recipe.link_port:04X}" in listening and f"00000000:{recipe.link_port:04X}" not in listening
    lab = subprocess.run([flwr, "supernode", "ls", "deployment", "--format", "json"], env={**recipe.procs.env, **recipe.job_env}, check=False, capture_output=True, text=True, timeout=120)
    for node in recipe.node_ids:  # the lab's nodes are all still registered
        assert str(node) in lab.stdout, lab.stdout + lab.stderr


def test_foreign_app_serverapp_never_executes(recipe):
    """Even submitted through the lab's own loopback connection, a foreign app's ServerApp is
    refused by the SuperLink's SuperExec (--trust-app): the marker it would write is absent."""
    app = recipe.work / "foreign"
    (app / "foreign").mkdir(parents=True)
    marker = recipe.work / "foreign-ran"
    (app / "pyproject.toml").write_text('[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n[project]\nname = "foreign"\nversion = "1.0.0"\n'
                                        'dependencies = []\n\n[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n[tool.flwr.app]\npublisher = "intruder"\n\n'
                                        '[tool.flwr.app.components]\nserverapp = "foreign.app:server"\nclientapp = "foreign.app:client"\n\n[tool.flwr.app.config]\n')
    (app / "foreign" / "__init__.py").write_text("")
    (app / "foreign" / "app.py").write_text(
        "from pathlib import Path\nfrom flwr.clientapp import ClientApp\nfrom flwr.serverapp import ServerApp\n"
        f"server = ServerApp()\nclient = ClientApp()\n\n@server.main()\ndef main(grid, context):\n    Path({str(marker)!r}).write_text(open({str(recipe.link / 'superlink.key')!r}).read())\n")
    argv = list(recipe.job_argv)
    argv[argv.index("--run-config"):argv.index("--run-config") + 2] = []
    done = subprocess.run([*argv, "--app", str(app), "--timeout", "120"], cwd=ROOT, env={**recipe.procs.env, **recipe.job_env}, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "finished:completed" not in done.stdout, done.stdout[-3000:]
    time.sleep(3)
    assert not marker.exists()
    print("FOREIGN", done.stdout[-3000:], (recipe.work / "superexec.log").read_text()[-3000:])
    assert "refused ServerApp" in (recipe.work / "superexec.log").read_text() + done.stdout and "finished:failed" in done.stdout


def test_rogue_superexec_without_the_secret_gets_no_run(recipe):
    """A flower-superexec without the shared secret, polling the loopback Runtime API (and one
    polling the network address): the lab's next run is executed by the lab's SuperExec only."""
    ca = str(recipe.link / "ca.crt")
    rogue, rogue_log = recipe.procs.start("rogue-superexec", ["flower-superexec", "--runtime-api-address", f"127.0.0.1:{recipe.link_port}", "--root-certificates", ca])
    remote, remote_log = recipe.procs.start("rogue-remote", ["flower-superexec", "--runtime-api-address", f"127.0.0.1:{recipe.port}", "--root-certificates", ca])
    time.sleep(3)
    before = (recipe.work / "superexec.log").read_text().count("started through fedpers.deploy.appguard")
    done = recipe.run(honest(recipe, recipe.work / "runs" / "second", epsilon="2.0"))
    assert done.returncode == 0 and "finished:completed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert (recipe.work / "superexec.log").read_text().count("started through fedpers.deploy.appguard") == before + 1  # the lab's SuperExec ran it
    for proc, log in ((rogue, rogue_log), (remote, remote_log)):
        text = log.read_text()
        assert "flwr-serverapp" not in text and "Launch" not in text, text[-2000:]
        proc.terminate()


@pytest.mark.parametrize(("extra", "rule"), [
    ({"epsilon": "inf"}, "max-epsilon"),
    ({"__run": "secure-noise=false"}, "require-secure-noise"),
])
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
    assert done.returncode != 0 and "rule 'max-epsilon'" in done.stdout and f"have spent epsilon={spent:g}" in done.stdout, done.stdout[-3000:]
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
        done = recipe.run(honest(recipe, recipe.work / "runs" / "small", epsilon="0.5", cohorts='"disjoint"', rounds="2"), timeout=200)
    finally:
        recipe.set_policy("superlink", POLICY)
    assert done.returncode != 0 and "finished:completed" not in done.stdout, done.stdout[-3000:]
    for i in range(3):
        assert "rule 'min-units'" in (recipe.work / f"supernode-{i}.log").read_text()


def test_a_node_with_a_modified_fedpers_refuses(recipe):
    """SuperNode 2 restarted with its commands.txt line but a modified fedpers first on its
    PYTHONPATH: it refuses every ClientApp (ModifiedCode), so the run cannot complete with it."""
    import signal

    from tests.flower_support import descendants, stop_processes

    argv, env = recipe.node_procs[2]
    old = next(p for p in recipe.procs.procs if p.args == argv)
    stop_processes([old])
    modified = recipe.work / "modified"
    shutil.copytree(ROOT / "fedpers", modified / "fedpers", ignore=shutil.ignore_patterns("__pycache__"))
    client = modified / "fedpers" / "runtime" / "flower" / "client.py"
    client.write_text(client.read_text() + "\nLEAKED = True  # a node operator's change\n")
    del signal, descendants
    recipe.procs.start("supernode-2-modified", argv, **{**env, "PYTHONPATH": str(modified)})
    time.sleep(5)
    done = recipe.run(honest(recipe, recipe.work / "runs" / "modified", epsilon="0.5"), timeout=200)
    assert "finished:completed" not in done.stdout, done.stdout[-3000:]
    text = (recipe.work / "supernode-2-modified.log").read_text()
    assert "ModifiedCode" in text and "runtime/flower/client.py" in text, text[-3000:]


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
    job = subprocess.Popen([*argv, "--timeout", "400"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        stopped = subprocess.run([flwr, "stop", run_id, "deployment"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
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
