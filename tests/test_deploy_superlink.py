"""`fedpers deploy superlink`'s gate: a connection to the SuperLink's port is served only when the uid
owning its other end (read from the kernel's socket table) is the SuperLink's own or an allowed one.
Another uid is played by a forked child that switches to `nobody` (skipped where this process cannot)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedpers.deploy import superlink
from tests.flower_support import can_switch_uid, free_port

NOBODY = 65534


def test_kernel_addresses_are_written_as_proc_net_tcp_writes_them() -> None:
    """The byte order of /proc/net/tcp{,6}: each 32-bit word of the address in host order, the port in hex."""
    import sys

    assert superlink._kernel_address("10.0.0.1", 443) == (
        "0100000A:01BB" if sys.byteorder == "little" else "0A000001:01BB"
    )
    assert superlink._kernel_address("::1", 1) == (
        "00000000" * 3 + ("01000000" if sys.byteorder == "little" else "00000001") + ":0001"
    )


def test_peer_uid_finds_the_owner_of_the_connecting_socket_and_nothing_else(tmp_path: Path) -> None:
    assert superlink._socket_pair_uid() == os.getuid()
    table = tmp_path / "tcp"
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = [  # the server's accepted socket (uid 0) and the client's (uid 1234), as the kernel lists a loopback pair
        "   0: 0100007F:2385 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 11 1\n",
        "   1: 0100007F:D431 0100007F:2385 01 00000000:00000000 00:00000000 00000000  1234        0 12 1\n",
    ]
    table.write_text(header + "".join(rows))
    server, client = ("127.0.0.1", 0x2385), ("127.0.0.1", 0xD431)
    assert superlink.peer_uid(client, server, [table]) == 1234
    assert superlink.peer_uid(("::ffff:127.0.0.1", 0xD431, 0, 0), ("::ffff:127.0.0.1", 0x2385, 0, 0), [table]) == 1234
    assert superlink.peer_uid(("127.0.0.1", 0xD432), server, [table]) is None  # no such local socket: another machine's
    assert superlink.peer_uid(client, server, [tmp_path / "missing"]) is None


def test_allowed_uids_are_this_process_and_the_ones_named() -> None:
    allowed, rest = superlink.allowed_uids(
        ["--host", "127.0.0.1", "--allow-uid", "1234", "--allow-uid", "nobody", "--port", "9"]
    )
    assert allowed == {os.getuid(), 1234, NOBODY} and rest == ["--host", "127.0.0.1", "--port", "9"]
    with pytest.raises(SystemExit, match="no user named"):
        superlink.allowed_uids(["--allow-uid", "no-such-user-here"])
    with pytest.raises(SystemExit, match="needs a uid"):
        superlink.allowed_uids(["--allow-uid"])


def test_a_superlink_on_the_network_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(superlink, "reexec_isolated", lambda argv: None)
    with pytest.raises(SystemExit, match="--host must be a loopback address"):
        superlink.superlink(["--host", "0.0.0.0", "--port", "9"])


@pytest.fixture
def gated_server() -> Iterator[tuple[int, dict[str, frozenset[int]]]]:
    """A uvicorn server (plain HTTP, answering 200 "served") with the gate; its allowed uids can be changed."""
    import uvicorn

    port = free_port()
    allowed = {"uids": frozenset({os.getuid()})}

    async def app(scope: dict, receive: object, send: object) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"6")]})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"served"})  # type: ignore[operator]

    class Gate(frozenset):  # the live set the fixture's test may change
        def __contains__(self, uid: object) -> bool:
            return uid in allowed["uids"]

    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=superlink.uid_gated_protocol(Gate()), lifespan="off", log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield port, allowed
    server.should_exit = True
    thread.join(timeout=30)


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
                if data.endswith(b"served"):
                    break
            return data
        except OSError:  # reset by the gate
            return b""


def _get_as(uid: int, port: int) -> bytes:
    """:func:`_get` from a forked child running as ``uid`` (its answer comes back on a pipe)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, _get(port)[:200] or b"-")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        got = r.read()
    os.waitpid(pid, 0)
    return b"" if got == b"-" else got


needs_root = pytest.mark.skipif(
    not can_switch_uid(NOBODY), reason="this process cannot switch to another uid (the tests run as root in CI)"
)


@needs_root
def test_another_uid_is_refused_before_any_request_is_read_and_the_own_uid_served(gated_server) -> None:
    port, allowed = gated_server
    assert _get(port).endswith(b"served")
    assert _get_as(NOBODY, port) == b""  # closed at once: no status line, nothing served
    assert _get(port).endswith(b"served")  # the server goes on
    allowed["uids"] = frozenset({os.getuid(), NOBODY})  # --allow-uid nobody
    assert _get_as(NOBODY, port).startswith(b"HTTP/1.1 200")
