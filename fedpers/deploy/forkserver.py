"""`fedpers deploy superexec`: Flower's SuperExec with a warm fork server for ClientApps (Flower internals: gated).

Flower 1.41 and 1.42 run every message of a deployment in a fresh ``flwr-clientapp`` process
that imports Python, flwr, torch and fedpers again (2.5–5 s here) — most of a deployment round;
their only warm executor pools are Kubernetes'. This runs Flower's own SuperExec loop
(``flower-superexec``, same flags) for a SuperNode, but launches each ClientApp task by forking
a process that has already imported all of that (including the Runtime API's HTTP stack and
every algorithm): the fork runs Flower's own ``run_clientapp`` with the task's one-time token,
exactly what ``flwr-clientapp --token`` runs, and exits. The fork server is a separate process
with no gRPC channel open (forking a process with live channels is unsafe) and runs no torch
operation (a forked OpenMP pool hangs); the SuperExec hands it each task's spec on a pipe. Other
task types keep Flower's subprocess executor. In the forks, a FAB already installed is not
extracted and re-hashed again, and missing message objects are asked for again after 10 ms
rather than 1 s (:mod:`.pulls`). The SuperExec's task poll is 0.05 s instead of 1 s through
Flower's public ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (unless set). Tied to the internals
listed in :mod:`.flower` (``run_superexec.get_executor``, ``run_clientapp``); refused on a
Flower series not checked there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from fedpers.deploy.flower import require_flower
from fedpers.deploy.isolation import isolated_env, python, reexec_isolated
from fedpers.deploy.pulls import quick_object_pulls

POLL_INTERVAL = "0.05"

PIN = (
    "import sys, types\n"
    "path = sys.argv[1] + '/deploy/integrity.py'\n"
    "with open(path, 'rb') as f:\n"
    "    own = f.read()\n"
    "integrity = types.ModuleType('_fedpers_pin')\n"
    "integrity.__file__ = path\n"
    "sys.modules[integrity.__name__] = integrity\n"
    "exec(compile(own, path, 'exec', dont_inherit=True), integrity.__dict__)\n"
    "integrity.pin_package(sys.argv[1], own)\n"
)
"""The first code the fork server runs (``python -I -c PIN... ROOT``): it compiles ``ROOT/deploy/integrity.py``
from the bytes it reads and pins the ``fedpers`` package at ROOT (:func:`fedpers.deploy.integrity.pin_package`),
so every fedpers module the server and its forks run is recorded by the hash of the bytes compiled."""
BOOT = PIN + "import fedpers.deploy.forkserver\nfedpers.deploy.forkserver.serve()\n"
"""The fork server's whole command (after :data:`PIN`): import the server through the pin and serve."""


from fedpers.deploy.trust import TRUSTED_APPS_ENV, UntrustedApp, trusted_apps  # noqa: E402  (re-exported)


def _install_trusted_once(install: Any) -> Any:
    """Flower's ``install_from_fab`` for a ClientApp: refused (:class:`UntrustedApp`, before anything
    is extracted) when ``$FEDPERS_TRUSTED_APPS`` is set and the FAB's SHA-256 is not in it; skipped
    when this FAB (by the SHA-256 of its bytes, as Flower names its install directory) was installed
    completely before: Flower extracts and re-hashes every file of the FAB into a temporary
    directory for each message (~0.15 s), then keeps the directory it already has."""
    import hashlib
    from pathlib import Path

    from flwr.common.config import get_flwr_home

    trusted = trusted_apps()

    def installed(fab_file: Any, *args: Any, **kwargs: Any) -> Path:
        if not isinstance(fab_file, bytes) and not trusted:
            return install(fab_file, *args, **kwargs)
        digest = hashlib.sha256(fab_file if isinstance(fab_file, bytes) else Path(fab_file).read_bytes()).hexdigest()
        if trusted and digest not in trusted:
            raise UntrustedApp(
                f"this SuperNode runs only the apps in {TRUSTED_APPS_ENV}; FAB {digest} is not one of them"
            )
        if not isinstance(fab_file, bytes) or args or kwargs.get("install_dir") is not None:
            return install(fab_file, *args, **kwargs)
        marker = get_flwr_home() / "apps" / f".fedpers-installed-{digest}"
        if marker.is_file():
            path = Path(marker.read_text())
            if path.is_dir():
                return path
        path = install(fab_file, *args, **kwargs)
        tmp = marker.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(str(path))
            os.replace(tmp, marker)
        except OSError:  # no marker: the next message installs again, as Flower would
            pass
        return path

    return installed


WARM_MODULES = (
    "httpcore",  # the Runtime API's HTTP stack (httpcore pulls in trio: ~0.75 s)
    "torch",
    "torch.utils.serialization",  # torch.save / torch.load of the node cache
    "fedpers.app",
    "fedpers.runtime.flower.client",  # the runtime the ClientApp is built from ...
    "fedpers.runtime.flower.secaggplus",  # ... which it imports when the app is built,
    "fedpers.runtime.flower.policy",  # ... and when a task arrives
    "fedpers.runtime.flower.nodeside",
    "fedpers.runtime.flower.nodeplan",
    "fedpers.runtime.distributed",
    "fedpers.results.securefs",
)
"""What the fork server imports once: everything a ClientApp execution would otherwise import in
each fork (compiled again from source where bytecode is not written: 20-40 ms a fork here)."""


def _warm() -> None:
    """Import :data:`WARM_MODULES` and every registered algorithm's module once (the registry
    itself imports them lazily), and set up OpenSSL once (each fork's Runtime API client makes an
    SSL context, even over plain HTTP: its first one in a process costs OpenSSL's set-up).
    Nothing here runs a torch operation or opens a connection."""
    import importlib
    import ssl

    from fedpers.experiments import ALGORITHMS

    for name in WARM_MODULES:
        importlib.import_module(name)
    for module, _, _ in ALGORITHMS.values():
        try:
            importlib.import_module(module)
        except ImportError:  # an optional dependency missing: that algorithm's tasks fail in their fork, as before
            pass
    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # a throwaway context: no certificates, never used


def serve() -> None:
    """The fork server: import once, then fork one child per JSON line on stdin."""
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime import run_clientapp as runtime

    _warm()
    runtime.install_from_fab = _install_trusted_once(runtime.install_from_fab)
    quick_object_pulls(runtime)
    run_clientapp = runtime.run_clientapp

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    print("ready", flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        if os.fork() == 0:  # the child: one ClientApp execution, as flwr-clientapp --token runs it
            code = 0
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                run_clientapp(
                    runtime_api_address=spec["runtime_api_address"],
                    token=spec["token"],
                    insecure=spec["insecure"],
                    certificates=validate_and_resolve_root_certificates(
                        spec["root_certificates_path"], spec["insecure"]
                    ),
                    parent_pid=spec["parent_pid"],
                    runtime_dependency_install=spec["runtime_dependency_install"],
                )
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)


def fork_server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The fork server's environment: the SuperExec's, isolated (:func:`fedpers.deploy.isolation.isolated_env`:
    no ``PYTHON*`` variable) and with Flower's public ``FLWR_TELEMETRY_ENABLED=0`` whatever the operator set.
    Otherwise every ClientApp execution sends two telemetry events to flower.ai (run enter and leave: the
    node's platform, the exit code and, by their timing, each round this data-holding node takes part in)
    and builds them in its fork (``platform.architecture()`` starts a ``file`` process; the exit waits up
    to 4 s for the send): 0.05–0.15 s of a loopback round here."""
    return isolated_env(environ)


def installed_root() -> str:
    """The directory of the fedpers this process runs (the SuperExec's, isolated: the installed one)."""
    import fedpers

    return os.path.dirname(os.path.abspath(fedpers.__file__))


class ForkServerExecutor:
    """Flower's executor interface: ClientApp tasks go to the fork server (restarted if it died),
    others to Flower's default — except with ``$FEDPERS_TRUSTED_APPS`` set, where other task types
    are refused (Flower's own processes would not check the app)."""

    def __init__(self, fallback: Any) -> None:
        self.fallback = fallback
        self.trusted = trusted_apps()
        self.server = self._start()

    @staticmethod
    def _start() -> subprocess.Popen[str]:
        server = subprocess.Popen(
            python("-c", BOOT, installed_root()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=fork_server_env(os.environ),
        )
        ready = server.stdout.readline().strip() if server.stdout else ""
        if ready != "ready":
            raise RuntimeError(f"fedpers fork server did not start (said {ready!r})")
        print(
            f"fedpers superexec: fork server ready, fedpers pinned at {installed_root()} (each fork checks it against the FAB)",
            file=sys.stderr,
            flush=True,
        )
        return server

    def launch(self, spec: Any) -> Any:
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor import LaunchResult

        if spec.task_type == TaskType.SERVER_APP and self.trusted:  # the SuperLink side of --trust-app
            from fedpers.deploy.appguard import launch_serverapp

            return launch_serverapp(self.fallback, spec, self.trusted)
        if spec.task_type != TaskType.CLIENT_APP:
            if self.trusted:
                return LaunchResult.failed(
                    f"{TRUSTED_APPS_ENV} is set: this node runs only ClientApps of trusted apps, not {spec.task_type}"
                )
            return self.fallback.launch(spec)
        if self.server.poll() is not None:
            print("fedpers superexec: the fork server exited; starting a new one", file=sys.stderr, flush=True)
            self.server = self._start()
        line = {
            k: getattr(spec, k)
            for k in (
                "runtime_api_address",
                "token",
                "insecure",
                "root_certificates_path",
                "parent_pid",
                "runtime_dependency_install",
            )
        }
        assert self.server.stdin is not None
        self.server.stdin.write(json.dumps(line) + "\n")
        self.server.stdin.flush()
        print(f"fedpers superexec: forked a warm ClientApp for task {spec.task_id}", file=sys.stderr, flush=True)
        return LaunchResult.accepted()

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.terminate()
        self.fallback.close()

    def __getattr__(self, name: str) -> Any:  # capacity checks, reconcile: as Flower's executor
        return getattr(self.fallback, name)


def take_trusted(argv: list[str]) -> list[str]:
    """Move every ``--trust-app SHA256`` of ``argv`` into ``$FEDPERS_TRUSTED_APPS`` (which the
    SuperExec and its fork server inherit); return the other arguments."""
    rest, hashes = [], [h for h in os.environ.get(TRUSTED_APPS_ENV, "").split(",") if h.strip()]
    it = iter(argv)
    for arg in it:
        if arg == "--trust-app":
            value = next(it, None)
            if value is None:
                raise SystemExit("--trust-app needs a FAB SHA-256 (fedpers deploy app-hash DIR prints it)")
            hashes.append(value)
        else:
            rest.append(arg)
    if hashes:
        os.environ[TRUSTED_APPS_ENV] = ",".join(hashes)
        trusted_apps()  # refuse a malformed digest now, not at the first message
    return rest


def app_hash(app: str = ".") -> str:
    """The SHA-256 of the FAB ``flwr run APP`` sends (Flower builds it deterministically: sorted
    files, fixed timestamps): what a node lists in ``--trust-app``."""
    import hashlib
    from pathlib import Path

    from flwr.cli.build import build_fab_from_disk

    if not (Path(app) / "pyproject.toml").is_file():
        raise SystemExit(f"app-hash: {app} is not a Flower app directory (no pyproject.toml)")
    return hashlib.sha256(build_fab_from_disk(Path(app))).hexdigest()


def superexec(argv: list[str]) -> int:
    """``flower-superexec ARGV`` with :class:`ForkServerExecutor` for ClientApp tasks."""
    import importlib

    require_flower("superexec")
    reexec_isolated(["fedpers", "deploy", "superexec", *argv])
    argv = take_trusted(argv)
    cli = importlib.import_module("flwr.supercore.cli.flower_superexec")
    loop = importlib.import_module("flwr.supercore.superexec.run_superexec")
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", POLL_INTERVAL)
    original = loop.get_executor
    loop.get_executor = lambda *a, **k: ForkServerExecutor(original(*a, **k))  # type: ignore[attr-defined]  # patches a private flwr module (gated)
    sys.argv = ["flower-superexec", *argv]
    cli.flower_superexec()
    return 0
