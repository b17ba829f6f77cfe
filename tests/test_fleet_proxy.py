"""The fleet proxy (the deployment's only network face) bounds what an unauthenticated client can make
it hold: a 200 MiB body is refused before it is read, slow headers are cut, an honest request is
answered beside 200 slow connections. The proxy runs as `fedpers deploy fleet-proxy` (TLS) with an
unreachable SuperLink behind it (its honest answer is then 502)."""
from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpers.deploy import make_certs
from fedpers.deploy.fleetproxy import MAX_BODY
from tests.flower_support import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_the_body_limit_holds_every_object_a_fedpers_run_sends() -> None:
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

    from fedpers.runtime.flower.codec import INLINE_BYTES

    assert MAX_BODY >= max(INLINE_BYTES, FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE) + (512 << 10)
    assert MAX_BODY <= 8 << 20


def _rss_kib(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS")))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    work = tmp_path_factory.mktemp("proxy")
    make_certs(work / "certs", ["127.0.0.1"], 1)
    link = work / "certs" / "superlink"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedpers", "deploy", "fleet-proxy", "--listen", f"127.0.0.1:{port}", "--superlink", f"127.0.0.1:{free_port()}",
                             "--ssl-certfile", str(link / "superlink.crt"), "--ssl-keyfile", str(link / "superlink.key"), "--ssl-ca-certfile", str(link / "ca.crt"),
                             "--header-timeout", "2"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    context = ssl.create_default_context(cafile=str(link / "ca.crt"))
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    yield proc, port, context
    proc.terminate()
    proc.wait(timeout=30)


def _connect(port: int, context: ssl.SSLContext, timeout: float = 30.0) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _status(sock: ssl.SSLSocket) -> int:
    data = b""
    while b"\r\n" not in data:
        got = sock.recv(4096)
        if not got:
            break
        data += got
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def _fleet_request(port: int, context: ssl.SSLContext) -> int:
    with _connect(port, context) as s:
        s.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        return _status(s)


def test_a_200_mib_body_is_refused_before_it_is_read(proxy) -> None:
    proc, port, context = proxy
    before = _rss_kib(proc.pid)
    chunk = b"\0" * (1 << 20)
    for declared in (True, False):  # with a Content-Length of 200 MiB, and chunked without one
        with _connect(port, context) as s:
            head = b"Content-Length: %d\r\n" % (200 << 20) if declared else b"Transfer-Encoding: chunked\r\n"
            s.sendall(b"POST /v1/fleet/push-object HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            sent = 0
            try:
                while sent < 200 << 20:
                    s.sendall(b"100000\r\n" + chunk + b"\r\n" if not declared else chunk)
                    sent += 1 << 20
            except OSError:
                pass  # the proxy answered and closed: the rest is never read
            # refused (or cut) without a 2xx/5xx forward; how much the client got into the socket buffers before
            # the cut depends on the machine's load, so what bounds the proxy is its memory, checked below
            assert _status(s) in (413, 0), sent
    grown = _rss_kib(proc.pid) - before
    assert grown < 64 << 10, f"proxy RSS grew {grown} KiB"
    assert _fleet_request(port, context) == 502  # still answering


@pytest.mark.slow
def test_slow_headers_are_cut_and_an_honest_request_is_answered_beside_200_of_them(proxy) -> None:
    proc, port, context = proxy
    slow = []
    for _ in range(200):
        s = _connect(port, context)
        s.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        slow.append(s)
    assert _fleet_request(port, context) == 502  # forwarded (to an unreachable SuperLink) at once
    time.sleep(3.5)  # past --header-timeout 2
    closed = 0
    for s in slow:
        s.settimeout(5)
        try:
            s.sendall(b"X-Slow: 1\r\n")
            closed += s.recv(1) == b""
        except OSError:
            closed += 1
        s.close()
    assert closed == 200
    fds = len(list(Path(f"/proc/{proc.pid}/fd").iterdir()))
    assert fds < 60, fds
