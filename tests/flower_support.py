"""Test-only Flower tooling: an in-process Grid, a fault-injecting ClientApp, process helpers.

Nothing here is imported by fedpers: faults are injected by wrapping the production
ClientApp handlers, never by flags inside them.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from flwr.app import Context, Error, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from fedpers.app import build_node
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.client import handle_query, handle_train

FAULTS = ("raise", "nan", "huge", "overclaim", "silent", "replay", "asymmetric", "partition-count")
"""raise: the ClientApp raises; nan: a NaN statistic; huge: a statistic of norm 1e30;
overclaim: claims 10⁹ units; silent: never replies (a timeout); replay: sends its previous
round's reply again; asymmetric: adds an antisymmetric part to a matrix statistic (norm
within the bound); partition-count: claims its whole partition as units and inflates its
statistics to match (a cohort holds fewer)."""


def faulty_client_app(faults: Mapping[int, str], from_round: int = 0) -> ClientApp:
    """The fedpers ClientApp, with partition → fault mode applied from round ``from_round`` on."""
    faults = dict(faults)
    previous: dict[int, RecordDict] = {}
    app = ClientApp()
    app.query()(handle_query)

    @app.train()
    def train(message: FlowerMessage, context: Context) -> FlowerMessage:
        mode = faults.get(int(context.node_config[codec.PARTITION_ID]))
        round = int(message.content[codec.JOB][codec.ROUND])
        if mode is None or round < from_round:
            return handle_train(message, context, build_node)
        if mode == "raise":
            raise RuntimeError("injected fault")
        if mode == "silent":
            time.sleep(float(os.environ.get("FEDPERS_TEST_SILENT_SECONDS", "3600")))
        honest = handle_train(message, context, build_node).content
        if mode == "replay":
            pid = int(context.node_config[codec.PARTITION_ID])
            stale = previous.get(pid, honest)
            previous[pid] = honest
            return FlowerMessage(stale, reply_to=message)
        reply = codec.decode_reply(honest)
        tag = honest.config_records[codec.TAG]
        first = sorted(reply.stats)[0]
        if mode == "nan":
            reply.stats[first] = (
                reply.stats[first]
                .clone()
                .view(-1)
                .index_fill(0, torch.tensor([0]), float("nan"))
                .view_as(reply.stats[first])
            )
        elif mode == "huge":
            reply.stats[first] = torch.full_like(reply.stats[first], 1e30 / reply.stats[first].numel() ** 0.5)
        elif mode == "overclaim":
            reply.count = 10**9
        elif mode == "asymmetric":
            name = next(k for k, v in sorted(reply.stats.items()) if v.dim() == 2)
            S = reply.stats[name]
            skew = torch.triu(torch.ones_like(S), diagonal=1)
            reply.stats[name] = S + 1e-3 * float(S.abs().max()) * (skew - skew.T)
        elif mode == "partition-count":
            task = codec.decode_task(message.content)
            claimed = task.stop - task.start
            scale = claimed / max(reply.count, 1)
            reply.stats = {k: v * scale for k, v in reply.stats.items()}
            reply.count = claimed
        return FlowerMessage(
            codec.encode_reply(reply, 0.0, tag[codec.ROUND], tag[codec.DIGEST_OF_BROADCAST]), reply_to=message
        )

    return app


class InProcessGrid:
    """A Flower Grid whose nodes run a ClientApp in this process (no Ray, no network).

    ``silent`` partitions receive messages but never answer; ``node_config`` extras are
    added to every node's config.
    """

    def __init__(
        self,
        app: ClientApp,
        partitions: int,
        *,
        silent: Iterable[int] = (),
        duplicate: bool = False,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
        rng = random.Random(1)
        self.app, self.silent = app, set(silent)
        self.contexts: dict[int, Context] = {}
        for p in range(partitions):
            node_id = rng.getrandbits(63)
            pid = 0 if duplicate and p == partitions - 1 else p
            self.contexts[node_id] = Context(
                run_id=1,
                node_id=node_id,
                node_config={codec.PARTITION_ID: pid, codec.NUM_PARTITIONS: partitions, **(extra or {})},
                state=RecordDict(),
                run_config={},
            )
        self._replies: dict[str, FlowerMessage] = {}
        self.sent: list[FlowerMessage] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[FlowerMessage]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.sent.append(msg)
            ids.append(msg.metadata.message_id)
            context = self.contexts[msg.metadata.dst_node_id]
            if int(context.node_config[codec.PARTITION_ID]) in self.silent and msg.metadata.message_type == "train":
                continue
            try:
                reply = self.app(msg, context)
            except Exception as e:
                reply = FlowerMessage(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=msg)
            self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[FlowerMessage]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on now, never one this process handed out before: Linux's bind to port 0
    draws from about 14,000 odd ports, so two calls gave the same port about once in 14,000 (measured: 16 in
    200,000 consecutive calls), and the ports one test holds at once (a Ray node's seven, a proxy and its
    upstream) would clash."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def descendants(pid: int) -> list[int]:
    """All living descendants of ``pid`` (from /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_processes(procs: Iterable[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM every process we started and its descendants, then SIGKILL what is left."""
    procs = list(procs)
    pids = []
    for p in procs:
        pids += [p.pid, *descendants(p.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def write_connection(flwr_home, name: str, address: str) -> None:
    """A ``$FLWR_HOME/config.toml`` with one insecure SuperLink connection (the 1.41 way)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\ninsecure = true\n'
    )


def wait_for_log(path, text: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{path.name}: {text!r} not seen (exit {proc.poll()}):\n{path.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.2)


class Processes:
    """Processes started by a test, each logging to a file; all stopped on exit, even on failure."""

    def __init__(self, workdir, env: Mapping[str, str]) -> None:
        self.workdir, self.env, self.procs = workdir, dict(env), []

    def start(
        self, name: str, cmd: list[str], *, cwd: os.PathLike[str] | None = None, **env: str
    ) -> tuple[subprocess.Popen, os.PathLike[str]]:
        """``cmd`` started in ``cwd`` (default: the work directory), logging to ``NAME.log`` there."""
        log = self.workdir / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=self.workdir if cwd is None else cwd,
                env={**self.env, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc, log

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_processes(self.procs)


def start_ray(
    log: Path, temp: Path, *, head_port: int | None = None, join: str | None = None, cpus: int = 2, attempts: int = 3
) -> subprocess.Popen:
    """``ray start --block`` on 127.0.0.1 with free ports: a head (``head_port``) or a worker joining ``join``.

    Ray gives its raylet a fixed 30 s to register with the GCS; on a loaded 2-core machine that start-up can
    time out once, so a failed start is stopped whole and tried again on fresh ports (``attempts`` in all),
    and the error names each attempt's log and the raylet's own error output."""
    failures: list[str] = []
    for attempt in range(attempts):
        cmd = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--num-cpus={cpus}",
            "--disable-usage-stats",
        ]
        if join is None:
            cmd += [
                "--head",
                f"--port={head_port}",
                f"--ray-client-server-port={free_port()}",
                "--include-dashboard=false",
                f"--temp-dir={temp}",
            ]
        else:
            cmd += [f"--address={join}"]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_processes([proc])
                raylet = sorted(temp.glob("session_*/logs/raylet.err"), key=lambda f: f.stat().st_mtime)
                tail = raylet[-1].read_text()[-1500:] if raylet else "(no raylet.err)"
                failures.append(f"attempt {attempt + 1}:\n{log.read_text()[-2000:]}\nraylet.err:\n{tail}")
                break
            time.sleep(0.2)
        else:
            return proc
        time.sleep(5)
    raise RuntimeError("ray start failed:\n" + "\n".join(failures))


def wait_for_ray_nodes(address: str, count: int, timeout: float = 120.0) -> None:
    """Until ``ray status`` lists ``count`` active nodes (a worker registers a moment after it
    prints that it started; on a loaded machine that moment can be seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        status = subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "status", f"--address={address}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        active = status.stdout.split("Pending:")[0]
        if active.count("node_") >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} Ray nodes not active after {timeout:g} s:\n{status.stdout}")
        time.sleep(1.0)


def start_superlink(procs: Processes, work: Path, *flags: str) -> int:
    """An insecure (loopback-only) SuperLink, Flower's ``flags`` added (e.g. ``--simulation``), ready for
    connections. Returns its port."""
    port = free_port()
    link, log = procs.start(
        "superlink",
        [
            "flower-superlink",
            "--insecure",
            *flags,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ],
        FLWR_HOME=str(work / "link-home"),
    )
    wait_for_log(log, "Starting Flower SuperExec", link)
    return port


def start_supernode(
    procs: Processes,
    work: Path,
    port: int,
    i: int,
    nodes: int,
    launcher: Sequence[str] = ("flower-supernode",),
    *,
    node_config: str = "",
    runtime_port: int = 0,
    flags: Sequence[str] = (),
) -> subprocess.Popen:
    """Insecure SuperNode ``i`` (partition ``i`` of ``nodes``, ``node_config`` added) of the SuperLink at
    ``port``, started by ``launcher`` with Flower's ``flags`` added; its runtime port ``runtime_port`` (0: a free one)."""
    config = f"partition-id={i} num-partitions={nodes}" + (f" {node_config}" if node_config else "")
    return procs.start(
        f"supernode{i}",
        [
            *launcher,
            "--insecure",
            "--superlink",
            f"127.0.0.1:{port}",
            "--port",
            str(runtime_port or free_port()),
            "--node-config",
            config,
            *flags,
        ],
        FLWR_HOME=str(work / f"node{i}-home"),
    )[0]


def start_loopback_federation(
    procs: Processes, work: Path, nodes: int, *, warm: bool = False, poll: float = 0.0
) -> int:
    """An insecure (loopback-only) SuperLink and ``nodes`` SuperNodes with partition ids 0..nodes−1;
    ``poll`` > 0: SuperNodes through ``fedpers deploy supernode --poll`` (whose own SuperExec is
    ``fedpers deploy superexec``: warm ClientApps); ``warm`` without ``poll``: ``flower-supernode
    --isolation process`` with ``fedpers deploy superexec`` beside each. Returns the SuperLink port."""
    import sys

    port = start_superlink(procs, work)
    for i in range(nodes):
        runtime = free_port()
        launcher = (
            [sys.executable, "-m", "fedpers", "deploy", "supernode", "--poll", str(poll)]
            if poll > 0
            else ["flower-supernode"]
        )
        separate = warm and poll <= 0  # fedpers deploy supernode starts fedpers deploy superexec itself
        start_supernode(
            procs,
            work,
            port,
            i,
            nodes,
            launcher,
            runtime_port=runtime,
            flags=["--isolation", "process"] if separate else [],
        )
        if separate:
            procs.start(
                f"superexec{i}",
                [
                    sys.executable,
                    "-m",
                    "fedpers",
                    "deploy",
                    "superexec",
                    "--runtime-api-address",
                    f"127.0.0.1:{runtime}",
                    "--insecure",
                ],
                FLWR_HOME=str(work / f"node{i}-home"),
            )
    return port


def can_switch_uid(uid: int = 65534) -> bool:
    """Whether a forked child of this process can become ``uid`` (root with CAP_SETUID: the tests' CI);
    tests that play another local user skip where it cannot."""
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
