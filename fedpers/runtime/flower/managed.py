"""Flower's supported simulation path for one run: a private SuperLink in simulation mode, ``flwr run``, then nothing left.

Flower deprecates its in-process simulation entry; what it supports is ``flwr run APP CONNECTION`` against a
SuperLink started with ``--simulation``: the SuperLink's SuperExec starts a ``flwr-simulation`` process that
installs the app's FAB, loads the ServerApp and the ClientApp by name from ``[tool.flwr.app.components]``
and runs them on Ray. :func:`run_app` does that for one run and owns every process it starts:

- the SuperLink is ``fedpers deploy superlink`` (Flower's own, whose port answers only this uid: the owner of
  each connection is read from the kernel's socket table) on a free loopback port, started from the app's
  own copy of fedpers, isolated (``python -I``, no ``PYTHON*`` variable), with a private ``FLWR_HOME`` (a
  0700 directory removed afterwards), runtime dependency installation off (Flower would otherwise ``uv
  sync`` the app's dependencies into a fresh environment for every run), Flower's telemetry and update
  check off, and ``RAY_ADDRESS`` set to the cluster to attach to or ``local`` (a new Ray: never silently
  the last ``ray start`` cluster on the machine, which is what ``ray.init()`` would join);
- the app goes in through Flower's own CLI, ``flwr run APP fedpers --stream``, whose log stream ends when
  the run does; its output (the ServerApp's and the nodes' logs) is kept in ``flower.log``;
- every process of the run carries :data:`MARKER` in its environment (Flower and Ray pass their
  environment on to the processes they start); on success, failure or Ctrl-C each one still running is
  sent SIGTERM, then SIGKILL, so no SuperLink, SuperExec, simulation or Ray process outlives the run.

This module moves processes and files only: what the app computes is the app's (``server/``, ``clients/``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "FEDPERS_SIMULATION_RUN"
"""Environment variable naming the run in every process started for it (how they are found to be stopped)."""
CONNECTION = "fedpers"
"""The connection name in the private ``FLWR_HOME/config.toml``."""
STARTUP_TIMEOUT = 180.0
"""Seconds the SuperLink may take to answer its health check (a loaded machine imports Flower slowly)."""
POLL_SECONDS = 0.2
STOP_GRACE = 10.0
"""Seconds between SIGTERM and SIGKILL when the run's processes are stopped."""
TASK_POLL_SECONDS = "0.1"
"""How often the SuperLink's SuperExec looks for the run (Flower's default, 1 s, is paid once per run)."""


class SimulationFailed(RuntimeError):
    """The SuperLink, ``flwr run`` or the simulation ended without the app finishing; carries Flower's log."""


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-I", "-c", code, *args]


def _die_with_parent() -> None:
    """In a child before it runs its program: the kernel sends it SIGTERM when this process dies, however
    it dies (SIGKILL included), so a run's SuperLink never outlives the process that owns the run (its
    SuperExec and simulation follow it: each watches its parent)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)


def superlink_command(app_dir: Path, port: int) -> list[str]:
    """``fedpers deploy superlink --simulation`` on 127.0.0.1:``port``, run from the app's own copy of
    fedpers (the code the run ships in its FAB), without runtime dependency installation."""
    boot = f"import sys; sys.path.insert(0, {str(app_dir)!r}); from fedpers.commands.cli import main; sys.exit(main())"
    return _python(
        boot,
        "deploy",
        "superlink",
        "--insecure",  # loopback only, and only this uid is answered (fedpers deploy superlink)
        "--simulation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    )


def flwr_command(*args: str) -> list[str]:
    """Flower's CLI (``flwr ARGS``) on this interpreter."""
    return _python("import sys; from flwr.cli.app import app; sys.argv[0] = 'flwr'; sys.exit(app())", *args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_environment(
    home: Path, marker: str, ray_address: str, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of every process of the run: this one's without ``PYTHON*`` variables, a private
    ``FLWR_HOME``, Flower's telemetry and update check off, its SuperExec polling quickly, Flower's log at
    INFO (the log is kept in a file: the ServerApp's error line must reach it) and ``RAY_ADDRESS``."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if not k.startswith("PYTHON")}
    env.update(
        {
            "FLWR_HOME": str(home / "flwr"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": TASK_POLL_SECONDS,
            "FLWR_LOG_LEVEL": "INFO",
            "RAY_ADDRESS": ray_address or "local",
            MARKER: marker,
        }
    )
    return env


def marked_processes(marker: str) -> list[int]:
    """Processes of this uid whose environment names the run ``marker`` (read from ``/proc``)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or another uid's
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_marked(marker: str, procs: list[subprocess.Popen[bytes]], grace: float = STOP_GRACE) -> list[int]:
    """SIGTERM every process of the run, wait up to ``grace`` seconds, SIGKILL what is left; returns
    the pids that needed SIGKILL."""
    pids = set(marked_processes(marker)) | {p.pid for p in procs if p.poll() is None}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for p in procs:
            p.poll()
        pids |= set(marked_processes(marker))  # started while stopping (a Ray worker)
        if not any(_alive(pid) for pid in pids):
            break
        time.sleep(0.1)
    killed = [pid for pid in pids | set(marked_processes(marker)) if _alive(pid)]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
    return killed


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_healthy(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = STARTUP_TIMEOUT) -> None:
    """Until the SuperLink on ``port`` answers its health check; its exit or the timeout is a
    :class:`SimulationFailed` with its log (a Flower series ``fedpers deploy superlink`` was not checked
    on is refused there, naming what to install)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SimulationFailed(
                f"the simulation's SuperLink exited ({proc.returncode}) before it answered:\n{_tail(log)}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise SimulationFailed(f"the simulation's SuperLink did not answer within {timeout:g} s:\n{_tail(log)}")
        time.sleep(POLL_SECONDS)


def write_connection(flwr_home: Path, port: int) -> None:
    """``FLWR_HOME/config.toml`` naming this run's SuperLink as connection :data:`CONNECTION`."""
    flwr_home.mkdir(mode=0o700, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )


def write_run_config(path: Path, run_config: Mapping[str, Any]) -> None:
    """The run config as a TOML file (what ``flwr run --run-config FILE`` reads)."""
    import tomli_w

    path.write_text(tomli_w.dumps(dict(run_config)))


def federation_args(federation_config: Mapping[str, Any]) -> list[str]:
    """``--federation-config "key=value ..."`` (TOML values)."""
    pairs = " ".join(f"{k}={json.dumps(v)}" for k, v in federation_config.items())
    return ["--federation-config", pairs]


@contextlib.contextmanager
def private_home(prefix: str = "fedpers-flower-") -> Iterator[Path]:
    """A directory only this uid can enter (0700), removed with everything in it afterwards."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


@dataclass
class Outcome:
    """What ``flwr run --stream`` printed (the ServerApp's and the nodes' logs), and the run's id."""

    run_id: str
    log: str


def run_app(
    app_dir: Path,
    run_config: Mapping[str, Any],
    federation_config: Mapping[str, Any],
    home: Path,
    *,
    ray_address: str = "",
    watch: Callable[[], None] | None = None,
    echo: bool = False,
    env: Mapping[str, str] | None = None,
) -> Outcome:
    """Run the Flower app in ``app_dir`` once on a private simulation SuperLink (see the module
    docstring); ``home``: a private directory for Flower's files and the logs. ``watch()`` is called
    every :data:`POLL_SECONDS` while the run goes (progress); ``echo``: Flower's log on stderr too;
    ``env``: variables added to the environment of the run's processes.
    Returns when the run ended, every process of it stopped."""
    marker = uuid.uuid4().hex
    env = {**run_environment(home, marker, ray_address), **(env or {})}
    write_run_config(home / "run_config.toml", run_config)
    procs: list[subprocess.Popen[bytes]] = []
    link_log, flower_log = home / "superlink.log", home / "flower.log"
    try:
        for attempt in range(3):  # a free port can be taken between the probe and the SuperLink's bind
            port = free_port()
            with open(link_log, "wb") as out:
                link = subprocess.Popen(
                    superlink_command(app_dir, port),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=os.getcwd(),  # the simulation's ServerApp resolves relative paths (out) as this process does
                    start_new_session=True,  # Ctrl-C reaches this process, which stops the run's processes
                    preexec_fn=_die_with_parent,
                )
            procs.append(link)
            try:
                wait_healthy(port, link, link_log)
                break
            except SimulationFailed:
                if attempt == 2 or "address already in use" not in _tail(link_log, 200).lower():
                    raise
        write_connection(home / "flwr", port)
        cmd = flwr_command(
            "run",
            str(app_dir),
            CONNECTION,
            "--stream",
            "--run-config",
            str(home / "run_config.toml"),
            *federation_args(federation_config),
        )
        with open(flower_log, "wb") as out:
            runner = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        procs.append(runner)
        shown = 0
        while runner.poll() is None:
            if watch is not None:
                watch()
            if echo:
                shown = _echo(flower_log, shown)
            time.sleep(POLL_SECONDS)
        if watch is not None:
            watch()
        if echo:
            _echo(flower_log, shown)
        text = flower_log.read_text(errors="replace")
        if runner.returncode != 0:
            raise SimulationFailed(f"flwr run exited with {runner.returncode}:\n{_tail(flower_log)}")
        run_id = next(
            (line.split()[-1] for line in text.splitlines() if line.startswith("Successfully started run")), ""
        )
        return Outcome(run_id, text)
    finally:
        stop_marked(marker, procs)


def read_log(home: Path) -> str:
    """What Flower printed for the run in ``home`` so far (``flower.log``), "" if nothing."""
    try:
        return (home / "flower.log").read_text(errors="replace")
    except OSError:
        return ""


def _echo(path: Path, shown: int) -> int:
    """Print what ``path`` gained since byte ``shown`` to stderr; returns the new offset."""
    with open(path, "rb") as f:
        f.seek(shown)
        data = f.read()
    if data:
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
    return shown + len(data)


class RoundFollower:
    """The progress of a run another process writes (the simulation's ServerApp): the phases and the
    round bar a run in this process shows, read from its run directory as it grows — ``config.json``
    (the ServerApp has started: the nodes are being waited for), each line of ``rounds.jsonl``, then
    ``result.json``. Call it repeatedly; it reads only what was added since the last call."""

    def __init__(self, run_dir: Path, *, rounds: int, desc: str, nodes: int, final: str, enabled: bool = True) -> None:
        self.run_dir, self.rounds, self.desc, self.nodes, self.final = run_dir, rounds, desc, nodes, final
        self.enabled = enabled
        self.seen = self.at_start = self._count()
        self.stage = "start"
        self.since = time.perf_counter()
        self.bar: Any = None

    def _count(self) -> int:
        path = self.run_dir / "rounds.jsonl"
        try:
            return path.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _close_phase(self, what: str) -> None:
        from fedpers.runtime.progress import QUIET_BELOW_S, say

        took = time.perf_counter() - self.since
        if took >= QUIET_BELOW_S:
            say(f"{what}: done in {took:.1f} s", self.enabled)
        self.since = time.perf_counter()

    def __call__(self) -> None:
        from fedpers.runtime.progress import say

        waiting = f"flower: waiting for {self.nodes} nodes to join (node start-up and discovery)"
        if self.stage == "start":
            say(f"flower: starting the simulation (a private SuperLink, Ray) for {self.nodes} nodes …", self.enabled)
            self.stage = "link"
        if self.stage == "link" and (self.run_dir / "config.json").is_file():
            self._close_phase("flower: starting the simulation")
            say(f"{waiting} …", self.enabled)
            self.stage = "nodes"
        count = self._count()
        if self.stage == "nodes" and count != self.at_start:
            self._close_phase(waiting)
            self.stage = "rounds"
            if self.enabled:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.rounds, desc=self.desc, unit="round", leave=False, initial=self.at_start)
        if self.stage == "rounds":
            self.seen = min(self.seen, count)  # a resumed run drops the round lines after its checkpoint
            if self.bar is not None and count > self.seen:
                self.bar.update(count - self.seen)
            self.seen = count
            if count >= self.rounds:
                if self.bar is not None:
                    self.bar.close()
                say(f"{self.final} …", self.enabled)
                self.since = time.perf_counter()
                self.stage = "final"
        if self.stage == "final" and (self.run_dir / "result.json").is_file():
            self._close_phase(self.final)
            self.stage = "done"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
