"""`fedpers deploy superlink`: Flower's SuperLink whose port answers only the lab's uid (Flower internals: gated).

Flower 1.41 and 1.42 serve the Control API (``flwr run/ls/log/stop``, ``flwr supernode
register/unregister``), the Runtime API and the Fleet API from one uvicorn server on
``--host``/``--port`` (``flwr/superlink/cli/flower_superlink.py``: ``uvicorn.run(host=..., port=...)``),
with no account authentication in the open-source build. On loopback that still lets every local uid
administer the federation: list and stop runs, submit runs, register and unregister SuperNodes.
Flower offers no Unix socket for it (``--host unix:PATH`` fails: uvicorn resolves it as a host name;
``--control-api-address`` is parsed as HOST:PORT and only adds a gRPC server beside the HTTP one), and
every Flower client (``flwr``, SuperExec, ServerApp, SuperNode) connects to ``https://HOST:PORT`` with a
plain ``httpx.Client``, so a socket file's permissions cannot be the gate.

The gate is therefore the peer's uid, taken from the kernel's socket table: this runs Flower's own
``flower-superlink`` (same flags) with each accepted connection's peer looked up in
``/proc/net/tcp``/``tcp6`` — the connecting socket's entry, whose owner is the uid that created it —
and closed at once, before any request is read, unless that uid is this process's own or one given
with ``--allow-uid`` (a lab member reaching the port through ``ssh -L``, as themselves). A peer with no
local entry (another machine) is refused too, so ``--host`` must be a loopback address: SuperNodes
reach the Fleet API through ``fedpers deploy fleet-proxy``, which runs as the lab's uid.

Runs isolated (:mod:`.isolation`) with Flower's telemetry off. Refused on a Flower series not checked
in :mod:`.flower`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedpers.deploy.flower import require_flower
from fedpers.deploy.isolation import reexec_isolated

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
"""The kernel's TCP socket tables (IPv4, IPv6) of this network namespace: one line per socket, with its owner's uid."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _kernel_address(host: str, port: int) -> str:
    """``host:port`` as ``/proc/net/tcp*`` prints it: the address's 32-bit words in this machine's byte
    order, in hex, then the port in hex (``127.0.0.1:8080`` → ``0100007F:1F90`` on little-endian)."""
    ip = ipaddress.ip_address(host.split("%")[0])
    packed = ip.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def peer_uid(peer: tuple[Any, ...], local: tuple[Any, ...], tables: Iterable[str | Path] = TCP_TABLES) -> int | None:
    """The uid owning the socket at the other end of a local TCP connection (``peer`` and ``local`` as
    ``getpeername``/``getsockname`` give them), or None when no local socket has that address pair
    (the peer is on another machine, or already gone). IPv4 peers of an IPv6 socket (``::ffff:a.b.c.d``)
    are looked up as IPv4."""
    keys = []
    for host, port in ((peer[0], int(peer[1])), (local[0], int(local[1]))):
        ip = ipaddress.ip_address(str(host).split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        keys.append((_kernel_address(str(mapped or ip), port), _kernel_address(str(ip), port)))
    wanted = {(keys[0][0], keys[1][0]), (keys[0][1], keys[1][1])}
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and (fields[1], fields[2]) in wanted:
                return int(fields[7])
    return None


class _RefusalLog:
    """One stderr line per second at most for refused connections (a local flood cannot fill the log)."""

    def __init__(self) -> None:
        self.last, self.missed = 0.0, 0

    def __call__(self, uid: int | None, allowed: frozenset[int]) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:
            self.missed += 1
            return
        more = f" ({self.missed} more since the last line)" if self.missed else ""
        who = "a peer with no local socket" if uid is None else f"uid {uid}"
        print(
            f"fedpers superlink: refused a connection from {who}: only uids {sorted(allowed)} reach this SuperLink{more}",
            file=sys.stderr,
            flush=True,
        )
        self.last, self.missed = now, 0


def uid_gated_protocol(allowed: frozenset[int], base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (``base``; default the one uvicorn picks, ``AutoHTTPProtocol``)
    that closes a connection as soon as it is made unless :func:`peer_uid` is in ``allowed``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    refused = _RefusalLog()

    class UidGatedProtocol(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            uid = peer_uid(peer, local) if peer and local else None
            if uid is None or uid not in allowed:
                refused(uid, allowed)
                transport.abort()  # nothing of the connection is read

    return UidGatedProtocol


class _GatedUvicorn:
    """``uvicorn`` for Flower's SuperLink module: ``run`` serves with :func:`uid_gated_protocol`."""

    def __init__(self, allowed: frozenset[int]) -> None:
        import uvicorn

        self._uvicorn, self._allowed = uvicorn, allowed

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._uvicorn.run(*args, **{**kwargs, "http": uid_gated_protocol(self._allowed)})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._uvicorn, name)


def allowed_uids(argv: list[str]) -> tuple[frozenset[int], list[str]]:
    """This process's uid plus every ``--allow-uid UID|NAME`` of ``argv``; the other arguments."""
    import pwd

    allowed, rest = {os.getuid()}, []
    it = iter(argv)
    for arg in it:
        if arg != "--allow-uid":
            rest.append(arg)
            continue
        value = next(it, None)
        if value is None:
            raise SystemExit(
                "--allow-uid needs a uid or a user name (a lab member who reaches the SuperLink as themselves)"
            )
        try:
            allowed.add(int(value) if value.isdigit() else pwd.getpwnam(value).pw_uid)
        except KeyError:
            raise SystemExit(f"--allow-uid: no user named {value!r} on this machine") from None
    return frozenset(allowed), rest


def _host(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--host="):
            return arg.split("=", 1)[1]
    return "127.0.0.1"  # Flower's default (UVICORN_DEFAULT_HOST)


def superlink(argv: list[str]) -> int:
    """``flower-superlink ARGV`` whose port answers only this uid and ``--allow-uid`` ones (see the module docstring)."""
    require_flower("superlink")
    allowed, rest = allowed_uids(argv)
    host = _host(rest)
    if host not in LOOPBACK_HOSTS:
        raise SystemExit(
            f"--host must be a loopback address ({', '.join(LOOPBACK_HOSTS[:3])}); got {host!r}: the SuperLink answers "
            "only local uids, and SuperNodes reach its Fleet API through fedpers deploy fleet-proxy"
        )
    reexec_isolated(["fedpers", "deploy", "superlink", *argv])
    argv = rest
    if _socket_pair_uid() != os.getuid():
        raise SystemExit(
            f"fedpers deploy superlink: the owner of a local connection cannot be read from {' or '.join(TCP_TABLES)} "
            "on this machine (Linux with /proc mounted is needed); run Flower's flower-superlink behind other access control"
        )
    import importlib

    cli = importlib.import_module("flwr.superlink.cli.flower_superlink")
    cli.uvicorn = _GatedUvicorn(allowed)  # type: ignore[attr-defined]  # patches a private flwr module (gated)
    print(f"fedpers superlink: answering uids {sorted(allowed)} only", file=sys.stderr, flush=True)
    sys.argv = ["flower-superlink", *argv]
    cli.flower_superlink()
    return 0


def _socket_pair_uid() -> int | None:
    """The uid :func:`peer_uid` finds for a loopback connection this process makes (its own: a self-check)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, peer = server.accept()
        try:
            return peer_uid(peer, conn.getsockname())
        finally:
            conn.close()
            client.close()
