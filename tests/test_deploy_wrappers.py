"""The pieces `fedpers deploy superexec` / `supernode` put into Flower 1.41: shorter object-pull
retries, a FAB installed once, capped SuperNode waits, the SuperNode's SuperExec swapped."""

from __future__ import annotations

import io
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

from fedpers.deploy import forkserver, pulls, supernode


def _puller(calls: list):
    def pull(object_ids, pull_object_fn, *, max_time=7200, max_tries_per_object=500, initial_backoff=1, backoff_cap=10):
        calls.append(
            {
                "initial_backoff": initial_backoff,
                "backoff_cap": backoff_cap,
                "max_tries_per_object": max_tries_per_object,
                "max_time": max_time,
            }
        )
        return {}

    return pull


def test_quick_object_pulls_shortens_retries_keeps_the_time_limit_and_caller_arguments() -> None:
    calls: list = []
    module = types.ModuleType("fake_flower_module")
    module.pull_objects = _puller(calls)
    pulls.quick_object_pulls(module)
    pulls.quick_object_pulls(module)  # idempotent: not wrapped twice
    module.pull_objects(["a"], lambda _: b"")
    module.pull_objects(["a"], lambda _: b"", initial_backoff=2.0)
    assert calls[0] == {
        "initial_backoff": pulls.FIRST_BACKOFF,
        "backoff_cap": pulls.BACKOFF_CAP,
        "max_tries_per_object": None,
        "max_time": 7200,
    }
    assert calls[1]["initial_backoff"] == 2.0
    assert module.pull_objects.func.__name__ == "pull"  # one partial over Flower's function


def test_quick_object_pulls_leaves_another_flower_series_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.99.0")
    module = types.ModuleType("fake_flower_module")
    module.pull_objects = original = _puller([])
    pulls.quick_object_pulls(module)
    assert module.pull_objects is original


def test_the_real_flower_pull_functions_accept_the_arguments() -> None:
    """The patched keywords exist on Flower's own functions (a rename in Flower fails here, not in a deployment)."""
    import inspect

    from flwr.supercore.inflatable import inflatable_utils

    for name in pulls.PULLERS:
        params = inspect.signature(getattr(inflatable_utils, name)).parameters
        assert {"initial_backoff", "backoff_cap", "max_tries_per_object", "max_time"} <= set(params)


def _fab(text: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("pyproject.toml", text)
    return buf.getvalue()


def _recording_install(tmp_path: Path, installs: list):
    """A stand-in for Flower's install_from_fab: records the call, makes a new app directory."""

    def install(fab_file, install_dir=None, skip_prompt=False):
        installs.append(fab_file)
        path = tmp_path / "apps" / f"app-{len(installs)}"
        path.mkdir(parents=True)
        return path

    return install


def test_a_fab_is_installed_once_per_content_and_again_when_its_directory_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    installs: list[bytes] = []
    install = _recording_install(tmp_path, installs)

    installed = forkserver._install_trusted_once(install)
    first = installed(_fab("a"), skip_prompt=True)
    assert installed(_fab("a"), skip_prompt=True) == first and len(installs) == 1
    other = installed(_fab("b"), skip_prompt=True)  # other bytes: installed, not taken for the first
    assert other != first and len(installs) == 2
    first.rmdir()  # an install directory removed by hand: installed again
    assert installed(_fab("a"), skip_prompt=True) != first and len(installs) == 3
    installed(tmp_path / "x.fab")  # a path, not bytes: always Flower's own install
    assert len(installs) == 4


def test_a_failed_install_leaves_no_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    (tmp_path / "apps").mkdir()

    def install(fab_file, install_dir=None, skip_prompt=False):
        raise RuntimeError("File hashes couldn't be verified.")

    with pytest.raises(RuntimeError, match="hashes"):
        forkserver._install_trusted_once(install)(_fab("a"), skip_prompt=True)
    assert list((tmp_path / "apps").iterdir()) == []


def test_supernode_waits_are_capped_network_at_poll_local_shorter(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    clock = supernode._PollingTime(0.2)
    monkeypatch.setattr(clock, "_time", types.SimpleNamespace(sleep=slept.append, monotonic=lambda: 5.0))
    clock.sleep(3)  # no message pulled: a network poll
    clock.sleep(0.5)  # a reply pending in the node's own state
    clock.sleep(0.001)
    assert slept == [0.2, supernode.LOCAL_WAIT, 0.001] and clock.monotonic() == 5.0


def test_supernode_polls_soon_after_a_message_then_backs_off_to_the_idle_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    clock = supernode._PollingTime(0.2)
    monkeypatch.setattr(clock, "_time", types.SimpleNamespace(sleep=slept.append))
    clock.sleep(3)
    clock.sleep(3)  # idle since start: every pull waits the full poll
    assert slept == [0.2, 0.2]
    slept.clear()
    clock.sleep(0.5)  # the node waited for a ClientApp's reply: it just worked on a message
    for _ in range(14):
        clock.sleep(3)
    polls = slept[1:]
    assert polls[0] == supernode.BUSY_POLL and polls[-1] == 0.2 and polls == sorted(polls)
    assert all(b == pytest.approx(min(a * supernode.POLL_GROWTH, 0.2)) for a, b in zip(polls, polls[1:]))
    assert sum(p < 0.2 for p in polls) <= 11  # back at the idle poll within about a second
    slept.clear()
    clock.sleep(0.5)  # the next message: soon again
    clock.sleep(3)
    assert slept == [supernode.LOCAL_WAIT, supernode.BUSY_POLL]
    slow = supernode._PollingTime(0.01)  # an idle poll below the busy one is never lengthened
    monkeypatch.setattr(slow, "_time", types.SimpleNamespace(sleep=slept.append))
    slow.sleep(0.5)
    slow.sleep(3)
    assert slept[-1] == 0.01


def test_the_supernode_starts_fedpers_superexec_and_nothing_else_is_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(supernode.subprocess, "Popen", lambda cmd, *a, **k: started.append(cmd))
    launcher = supernode._WarmSuperExecLauncher()
    launcher.Popen(["flower-superexec", "--insecure", "--runtime-api-address", "127.0.0.1:9094", "--parent-pid", "7"])
    launcher.Popen(["flwr-clientapp", "--token", "t"])
    assert started[0] == [
        sys.executable,
        "-I",
        "-m",
        "fedpers",
        "deploy",
        "superexec",
        "--insecure",
        "--runtime-api-address",
        "127.0.0.1:9094",
        "--parent-pid",
        "7",
    ]
    assert started[1] == ["flwr-clientapp", "--token", "t"]
    assert launcher.DEVNULL is supernode.subprocess.DEVNULL


def test_an_untrusted_app_is_refused_before_anything_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    trusted, other = _fab("lab app"), _fab("intruder app")
    monkeypatch.setenv(forkserver.TRUSTED_APPS_ENV, hashlib.sha256(trusted).hexdigest().upper() + ", " + "0" * 64)
    installs: list[bytes] = []
    install = _recording_install(tmp_path, installs)

    installed = forkserver._install_trusted_once(install)
    with pytest.raises(forkserver.UntrustedApp, match=hashlib.sha256(other).hexdigest()):
        installed(other, skip_prompt=True)
    assert installs == []
    installed(trusted, skip_prompt=True)
    with pytest.raises(forkserver.UntrustedApp):  # a marker from an earlier install does not bypass the check
        installed(other, skip_prompt=True)
    assert installs == [trusted]


def test_trust_flags_are_taken_out_and_malformed_digests_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(forkserver.TRUSTED_APPS_ENV, raising=False)
    rest = forkserver.take_trusted(
        ["--insecure", "--trust-app", "a" * 64, "--superlink", "h:1", "--trust-app", "b" * 64]
    )
    assert rest == ["--insecure", "--superlink", "h:1"]
    assert forkserver.trusted_apps() == {"a" * 64, "b" * 64}
    for bad in (["--trust-app", "abc"], ["--trust-app", "g" * 64], ["--trust-app"]):
        monkeypatch.delenv(forkserver.TRUSTED_APPS_ENV, raising=False)
        with pytest.raises(SystemExit, match="trust-app|SHA-256"):
            forkserver.take_trusted(bad)


def test_with_trusted_apps_other_task_types_never_reach_flowers_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import LaunchResult

    launched: list = []
    fallback = types.SimpleNamespace(launch=lambda spec: launched.append(spec) or LaunchResult.accepted())
    executor = object.__new__(forkserver.ForkServerExecutor)
    executor.fallback, executor.trusted = fallback, frozenset({"a" * 64})
    other = next(
        t for t in TaskType if t not in (TaskType.CLIENT_APP, TaskType.SERVER_APP)
    )  # ServerApps: the next test
    result = executor.launch(types.SimpleNamespace(task_type=other, task_id=1))
    assert result.status == "failed" and launched == []
    executor.trusted = frozenset()
    assert (
        executor.launch(types.SimpleNamespace(task_type=other, task_id=2)).status == "accepted" and len(launched) == 1
    )


def test_a_superlink_side_superexec_starts_only_trusted_serverapps_through_the_guard() -> None:
    """With --trust-app, every ServerApp task is launched by Flower's executor with
    flwr-serverapp replaced by `python -m fedpers.deploy.appguard` (which refuses an unlisted FAB on its bytes)."""
    import sys

    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import LaunchResult
    from flwr.supercore.superexec.executor import subprocess_executor as flower

    commands: list = []

    def launch(spec):
        commands.append(flower.subprocess)
        return LaunchResult.accepted()

    executor = object.__new__(forkserver.ForkServerExecutor)
    executor.fallback, executor.trusted = types.SimpleNamespace(launch=launch), frozenset({"a" * 64})
    for i, digest in enumerate(
        ["b" * 64, "a" * 64, None]
    ):  # unlisted, listed, unknown: all through the guard, never Flower's own
        assert (
            executor.launch(types.SimpleNamespace(task_type=TaskType.SERVER_APP, task_id=i + 1, fab_hash=digest)).status
            == "accepted"
        )
    from fedpers.deploy.appguard import _GuardedLauncher

    assert len(commands) == 3 and all(isinstance(c, _GuardedLauncher) for c in commands)
    assert flower.subprocess.__name__ == "subprocess"  # restored after each launch
    started: list = []
    guard = _GuardedLauncher()
    import subprocess

    real = subprocess.Popen
    piped: list = []

    class Started:
        def __init__(self, cmd, *a, **k):
            started.append(cmd)
            self.stdin = open(os.devnull, "wb") if k.get("stdin") == subprocess.PIPE else None
            piped.append(k.get("stdin") == subprocess.PIPE)

    subprocess.Popen = Started
    try:
        guard.Popen(["flwr-serverapp", "--token", "t"])
        guard.Popen(["flwr-clientapp", "--token", "t"])
    finally:
        subprocess.Popen = real
    from fedpers.deploy.appguard import TOKEN_STDIN

    # the ServerApp's token travels on its stdin, never on its command line (/proc/PID/cmdline)
    assert started == [
        [sys.executable, "-I", "-m", "fedpers.deploy.appguard", TOKEN_STDIN],
        ["flwr-clientapp", "--token", "t"],
    ]
    assert piped == [True, False]


def test_the_guard_reads_the_token_from_a_pipe_and_no_process_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real child started as the guard starts flwr-serverapp: its /proc/PID/cmdline (world-readable)
    holds no token; it gets the token on its stdin, and the guard's argv parsing puts it back in sys.argv only."""
    import io
    import subprocess
    import sys

    from fedpers.deploy.appguard import TOKEN_STDIN, hide_token, start_with_token, token_from_stdin

    secret = "f" * 40
    command, token = hide_token(
        [
            sys.executable,
            "-c",
            "import sys; print(open('/proc/self/cmdline').read()); print(sys.stdin.readline().strip())",
            "--token",
            secret,
            "--insecure",
        ]
    )
    proc = start_with_token(command, token, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    cmdline, received = out.splitlines()
    assert secret not in cmdline and TOKEN_STDIN in cmdline and received == secret
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(secret.encode() + b"\n")))
    assert token_from_stdin(["--x", TOKEN_STDIN, "--insecure"]) == ["--x", "--token", secret, "--insecure"]
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(b"")))
    with pytest.raises(SystemExit, match="no task token"):
        token_from_stdin([TOKEN_STDIN])


def test_app_hash_is_the_hash_of_the_fab_flwr_run_sends(tmp_path: Path) -> None:
    import hashlib
    import shutil

    from flwr.cli.build import build_fab_from_disk

    root = Path(__file__).resolve().parents[1]
    assert forkserver.app_hash(str(root)) == hashlib.sha256(build_fab_from_disk(root)).hexdigest()
    app = tmp_path / "app"
    for part in ("clients", "server", "fedpers"):  # what the pyproject's fab-include names
        shutil.copytree(root / part, app / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", app / "pyproject.toml")
    first = forkserver.app_hash(str(app))
    assert forkserver.app_hash(str(app)) == first  # deterministic
    (app / "clients" / "client_app.py").write_text((app / "clients" / "client_app.py").read_text() + "\n# changed\n")
    assert forkserver.app_hash(str(app)) != first  # any changed file is another app
    with pytest.raises(SystemExit, match="no pyproject.toml"):
        forkserver.app_hash(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("1.41.0", True),
        ("1.42.0", True),
        ("1.42.3", True),
        ("1.43.0", False),
        ("1.40.1", False),
        ("2.41.0", False),
        ("", False),
    ],
)
def test_the_gate_knows_the_checked_series(version: str, ok: bool) -> None:
    from fedpers.deploy import flower

    assert flower.supported(version) is ok


@pytest.mark.parametrize("command", ["superexec", "supernode", "superlink"])
def test_an_unchecked_flower_series_is_refused_with_what_to_do(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before anything of Flower is patched: the message names the version, Flower's own command and the pip range."""
    import flwr

    from fedpers.commands.cli import main

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    with pytest.raises(SystemExit) as refused:
        main(["deploy", command, "--insecure"])
    text = str(refused.value)
    assert (
        "flwr 1.43.0" in text and f"flower-{command}" in text and "pip install 'flwr[simulation]>=1.41,<1.43'" in text
    )


def test_a_deployed_serverapp_on_an_unchecked_series_keeps_flowers_pulls(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    module = types.ModuleType("fake_grid_module")
    module.pull_objects = original = _puller([])
    grid_type = type("HttpGrid", (), {"__module__": "fake_grid_module"})
    monkeypatch.setitem(sys.modules, "fake_grid_module", module)
    assert pulls.quick_grid_pulls(grid_type()) is False
    assert module.pull_objects is original and "1.43.0" in caplog.text


_ONE_EXECUTION = """
import pickle, sys
from flwr.supercore.tls import validate_and_resolve_root_certificates  # what serve() imports, then _warm()
from flwr.supernode.runtime import run_clientapp
from fedpers.deploy import forkserver

forkserver._warm()
warm = set(sys.modules)
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedpers.app import make_client_app

TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # as run_clientapp's pull sets them
content, node_config = pickle.loads(sys.stdin.buffer.read())
for _ in range(2):  # the node cache is written, then read
    context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    reply = make_client_app()(Message(content, 1, MessageType.TRAIN), context)
    assert not reply.has_error(), reply.error
print(" ".join(sorted(m for m in set(sys.modules) - warm if m.split(".")[0] in ("fedpers", "torch", "flwr", "cryptography", "numpy"))))
"""


@pytest.mark.slow
def test_a_warm_fork_imports_no_module_for_a_clientapp_execution(tmp_path: Path) -> None:
    """What the fork server imports (``_warm``) covers a ClientApp execution's own imports — building
    the app, the policy, node-side and SecAgg+ modules, the node cache — so no fork compiles them again."""
    import pickle
    import subprocess

    from fedpers import config as config_lib
    from fedpers.app import make_client_app, run_flower
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import EXPERIMENTS
    from fedpers.privacy import Privatizer
    from tests.flower_support import InProcessGrid

    exp = EXPERIMENTS["altmin"]
    cfg = config_lib.build(
        exp.config_type,
        {"n_users": 40, "dim": 4, "rank": 2, "samples_per_user": 8, "rounds": 1, "seed": 1, "cohorts": "all"},
    )
    grid = InProcessGrid(make_client_app(), 1)
    options = config_lib.build(RuntimeOptions, {"runtime": "flower", "round_timeout": 5.0})
    run_flower(exp, cfg, exp.protocol(cfg), Privatizer(1), options, grid=grid, progress=False)
    task = next(m for m in reversed(grid.sent) if m.metadata.message_type == "train")
    node_config = dict(next(iter(grid.contexts.values())).node_config)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "FEDPERS_NODE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _ONE_EXECUTION],
        input=pickle.dumps((task.content, node_config)),
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode().split() == [], done.stdout.decode()


def test_every_process_started_on_a_node_or_for_a_serverapp_is_isolated_and_sends_no_telemetry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fork server (every ClientApp execution) and the ServerApp guard run as `python -I` in an environment
    without PYTHON* variables and with FLWR_TELEMETRY_ENABLED=0, even where the operator set 1; the rest of
    the environment is the SuperExec's, which itself is left unchanged."""
    import subprocess

    from fedpers.deploy.appguard import _GuardedLauncher
    from fedpers.deploy.isolation import TELEMETRY_ENV

    started: list[tuple[list[str], dict]] = []

    def popen(cmd: list[str], *args: object, **kwargs: object) -> object:
        started.append((cmd, kwargs["env"]))  # type: ignore[arg-type]
        return types.SimpleNamespace(stdout=io.StringIO("ready\n"), stdin=open(os.devnull, "wb"))

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv(TELEMETRY_ENV, "1")
    monkeypatch.setenv("PYTHONPATH", "/planted")
    monkeypatch.setenv("FEDPERS_NODE_CACHE", "/somewhere")
    forkserver.ForkServerExecutor._start()
    _GuardedLauncher().Popen(["flwr-serverapp", "--token", "t"])
    (server, server_env), (guard, guard_env) = started
    assert server == [sys.executable, "-I", "-c", forkserver.BOOT, forkserver.installed_root()] and guard[:2] == [
        sys.executable,
        "-I",
    ]
    for env in (server_env, guard_env):
        assert env[TELEMETRY_ENV] == "0" and env["FEDPERS_NODE_CACHE"] == "/somewhere"
        assert not [k for k in env if k.startswith("PYTHON")]
    assert os.environ[TELEMETRY_ENV] == "1" and os.environ["PYTHONPATH"] == "/planted"  # the SuperExec's own: unchanged


def test_reexec_isolated_replaces_the_process_with_python_i_in_a_clean_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `fedpers deploy` command started from the operator's shell re-executes itself as `python -I -m fedpers ...`
    with the PYTHON* variables dropped and telemetry off; one already started so returns."""
    from fedpers.deploy import isolation

    calls: list = []
    monkeypatch.setattr(isolation.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.setenv("PYTHONPATH", "/planted")
    isolation.reexec_isolated(["fedpers", "deploy", "supernode", "--insecure"])
    ((exe, argv, env),) = calls
    assert exe == sys.executable and argv == [
        sys.executable,
        "-I",
        "-m",
        "fedpers",
        "deploy",
        "supernode",
        "--insecure",
    ]
    assert "PYTHONPATH" not in env and env[isolation.TELEMETRY_ENV] == "0"
    monkeypatch.setattr(isolation.sys, "flags", types.SimpleNamespace(isolated=1))
    monkeypatch.setattr(isolation.os, "environ", isolation.isolated_env(os.environ))
    isolation.reexec_isolated(["fedpers", "deploy", "supernode"])
    assert len(calls) == 1


def test_an_isolated_process_never_imports_a_fedpers_from_its_working_directory(tmp_path: Path) -> None:
    """A `fedpers` package in the working directory: `python -m fedpers` imports it, the isolated command
    every fedpers process on a node is started with (`python -I`) imports the installed one."""
    import subprocess

    from fedpers.deploy.isolation import isolated_env, python

    (tmp_path / "fedpers").mkdir()
    (tmp_path / "fedpers" / "__init__.py").write_text("")
    (tmp_path / "fedpers" / "__main__.py").write_text("print('PLANTED')\n")
    env = isolated_env(os.environ)
    plain = subprocess.run(
        [sys.executable, "-m", "fedpers", "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    isolated = subprocess.run(
        python("-m", "fedpers", "--version"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert (
        plain.stdout.strip() == "PLANTED"
    )  # what the fork server's `python -m fedpers.deploy.forkserver` was exposed to
    assert isolated.returncode == 0 and "PLANTED" not in isolated.stdout and isolated.stdout.strip(), (
        isolated.stdout + isolated.stderr
    )
