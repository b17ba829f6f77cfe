"""`fedpers deploy fleet-proxy`: the only network face of a SuperLink — its Fleet API, nothing else.

Flower 1.41 (and 1.42) serve the Fleet API (SuperNodes), the Control API (``flwr run``/``ls``/
``log``, ``flwr supernode register``/``unregister``) and the Runtime API (SuperExec, ServerApp)
on one ``--host``/``--port``: ``--fleet-api-address`` and ``--control-api-address`` are
deprecated and ignored for the HTTP APIs. The open-source Control API has no account
authentication, so whoever reaches that port administers the federation. The recipe therefore
binds the SuperLink to 127.0.0.1 and puts this proxy on the network address: a TLS server (the
SuperLink's certificate) that forwards ``POST /v1/fleet/*`` to the loopback SuperLink (over TLS,
checked against the lab's CA) and answers 404 to every other path. SuperNode authentication is
Flower's own (signed requests, checked by the SuperLink), untouched by the proxy.

Built on uvicorn and httpx (both Flower dependencies).
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
from dataclasses import dataclass
from typing import Any

FLEET_PREFIX = "/v1/fleet/"
"""The only paths forwarded: Flower 1.41's Fleet API router (``flwr/superlink/routers/fleet``)."""
_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "host",
    "content-length",
}
MAX_BODY = 6 * 1024 * 1024
"""Largest request body forwarded: one Flower object, the largest any fedpers run sends. Flower pushes a
message object by object and cuts arrays into chunks of 5 MiB (``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``);
fedpers packs a reply's statistics inline up to 4 MiB (``codec.INLINE_BYTES``), above that as one
chunked array. 6 MiB leaves room for the protobuf framing (tests/test_fleet_proxy.py checks the two
constants). A larger body is refused from its Content-Length before any of it is read, or as soon as
a body without one passes the limit."""
HEADER_TIMEOUT = 10.0
"""Seconds a connection may take to send a request's headers (from connecting, or from the last
response on a kept-alive connection) before it is closed: slow-header connections cannot pile up."""
BODY_GRACE = 10.0
"""Seconds a request's body may take before :data:`MIN_BODY_RATE` applies: the body must have arrived
by ``BODY_GRACE + bytes received / MIN_BODY_RATE`` seconds after its headers, or the connection is cut
(408). A 6 MiB body may take 202 s; a client trickling bytes is cut after about 10 s."""
MIN_BODY_RATE = 32 * 1024
"""Bytes a second a request body must average after :data:`BODY_GRACE` (256 kbit/s: an honest
SuperNode's largest object, 5 MiB, on a link of that speed)."""
MAX_CONNECTIONS = 512
"""Open connections at most. A new one beyond it takes the place of the connection that has been
waiting longest for a request's headers or body (an honest SuperNode's connection waits a poll
interval at most: 0.2 s with ``fedpers deploy supernode``, 3 s with Flower's); only when every open
connection is busy forwarding is the new one closed."""
MAX_PER_ADDRESS = 32
"""Open connections from one client address at most (an IPv6 client: its /64); beyond it a new one is
closed at once. A SuperNode holds one or two."""
MAX_BUFFERED = 64 * 1024 * 1024
"""Bytes of request bodies and responses the proxy holds at once, over all connections: a request or
response that would go past it is answered 503 (Flower's clients retry 503 with backoff)."""
TLS_READ_BUFFER = 32 * 1024
"""Bytes of the read buffer of each TLS connection (asyncio's default: 256 KiB, allocated with every
connection — 128 MiB for 512 connections that send nothing). TLS records are at most 16 KiB."""


@dataclass(frozen=True)
class Limits:
    """What an unauthenticated client can make the proxy hold (the module's constants; see each)."""

    max_body: int = MAX_BODY
    header_timeout: float = HEADER_TIMEOUT
    body_grace: float = BODY_GRACE
    min_body_rate: float = MIN_BODY_RATE
    max_connections: int = MAX_CONNECTIONS
    max_per_address: int = MAX_PER_ADDRESS
    max_buffered: int = MAX_BUFFERED

    def __post_init__(self) -> None:
        checks = {
            "max_body": (self.max_body, 1, 512 << 20),
            "header_timeout": (self.header_timeout, 1e-3, 600.0),
            "body_grace": (self.body_grace, 1e-3, 600.0),
            "min_body_rate": (self.min_body_rate, 1.0, float(1 << 30)),
            "max_connections": (self.max_connections, 1, 1 << 20),
            "max_per_address": (self.max_per_address, 1, 1 << 20),
            "max_buffered": (self.max_buffered, self.max_body, 1 << 40),
        }
        for name, (value, low, high) in checks.items():
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low:g}, {high:g}]; got {value:g}")

    def bound(self) -> int:
        """Bytes the proxy may buffer at most: :attr:`max_buffered` plus, per open connection, its TLS read
        buffer, uvicorn's body buffer before it pauses reading (64 KiB) and h11's incomplete headers (16 KiB)."""
        return self.max_buffered + self.max_connections * (TLS_READ_BUFFER + (64 << 10) + (16 << 10))


def address_key(host: str) -> str:
    """The group a client address is counted in: an IPv4 address itself, an IPv6 address its /64."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        return str(mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Occupancy:
    """What the proxy holds now: its open connections (by client address, and since when each has been
    waiting for a request) and the bytes of bodies and responses it buffers (see :class:`Limits`)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.waiting_since: dict[Any, float] = {}  # connection → when it began waiting; absent while it forwards
        self.key: dict[Any, str] = {}
        self.per_address: dict[str, int] = {}
        self.by_peer: dict[tuple[str, int], Any] = {}
        self.buffered = 0
        self.evicted = self.refused = 0

    def admit(self, conn: Any, peer: tuple[str, int] | None, now: float) -> bool:
        """Register ``conn`` (False: refuse it). At the address cap it is refused; at the total cap the
        connection waiting longest is aborted for it, or it is refused when every connection forwards."""
        key = address_key(peer[0]) if peer else ""
        if self.per_address.get(key, 0) >= self.limits.max_per_address:
            self.refused += 1
            return False
        if len(self.key) >= self.limits.max_connections:
            if not self.waiting_since:
                self.refused += 1
                return False
            victim = min(self.waiting_since, key=self.waiting_since.__getitem__)
            self.leave(victim)
            self.evicted += 1
            victim.transport.abort()
        self.key[conn] = key
        self.per_address[key] = self.per_address.get(key, 0) + 1
        self.waiting_since[conn] = now
        if peer:
            self.by_peer[(peer[0], int(peer[1]))] = conn
        return True

    def leave(self, conn: Any) -> None:
        key = self.key.pop(conn, None)
        if key is None:
            return
        self.per_address[key] -= 1
        if not self.per_address[key]:
            del self.per_address[key]
        self.waiting_since.pop(conn, None)
        peer = getattr(conn, "client", None)
        if peer and self.by_peer.get((peer[0], int(peer[1]))) is conn:
            del self.by_peer[(peer[0], int(peer[1]))]

    def forwarding(self, peer: Any, busy: bool, now: float) -> None:
        """The connection of ``peer`` forwards a request (``busy``) or waits for the next one again."""
        conn = self.by_peer.get((peer[0], int(peer[1]))) if peer else None
        if conn is None or conn not in self.key:
            return
        if busy:
            self.waiting_since.pop(conn, None)
        else:
            self.waiting_since[conn] = now

    def reserve(self, size: int) -> bool:
        """Count ``size`` more bytes held (False, counting nothing, when that would pass ``max_buffered``)."""
        if self.buffered + size > self.limits.max_buffered:
            return False
        self.buffered += size
        return True

    def release(self, size: int) -> None:
        self.buffered -= size


def make_app(
    upstream: str,
    ca_file: str | None,
    *,
    timeout: float = 120.0,
    limits: Limits | None = None,
    occupancy: Occupancy | None = None,
) -> Any:
    """The ASGI application: Fleet API requests to ``upstream`` (``https://127.0.0.1:PORT``), others 404.
    Bodies and responses are counted in ``occupancy`` (one per proxy, shared with its connections)."""
    import httpx

    limits = limits or Limits()
    occupancy = occupancy or Occupancy(limits)
    verify: Any = ssl.create_default_context(cafile=ca_file) if ca_file else True
    state: dict[str, Any] = {}

    async def reply(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-length", str(len(body)).encode()), *(headers or [])],
            }
        )
        await send({"type": "http.response.body", "body": body})

    close = [(b"connection", b"close")]
    busy = [*close, (b"retry-after", b"1")]

    async def body(receive: Any, send: Any) -> tuple[list[bytes], int] | None:
        """The request's body, at least ``min_body_rate`` after ``body_grace`` and within the limits (None: refused)."""
        loop = asyncio.get_running_loop()
        start, chunks, size = loop.time(), [], 0
        while True:
            due = start + limits.body_grace + size / limits.min_body_rate
            try:
                message = await asyncio.wait_for(receive(), max(due - loop.time(), 0.0))
            except TimeoutError:
                await reply(send, 408, b"request body too slow\n", close)
                occupancy.release(size)
                return None
            if message["type"] == "http.disconnect":  # the client left: nothing is forwarded
                occupancy.release(size)
                return None
            chunk = message.get("body", b"")
            if size + len(chunk) > limits.max_body:
                await reply(send, 413, b"request body too large\n", close)
                occupancy.release(size)
                return None
            if not occupancy.reserve(len(chunk)):
                await reply(send, 503, b"proxy busy: too many bytes in flight\n", busy)
                occupancy.release(size)
                return None
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body"):
                return chunks, size

    async def forward(scope: dict, chunks: list[bytes], size: int, send: Any) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.decode().lower() not in _HOP]
        headers.append((b"content-length", str(size).encode()))
        query = scope.get("query_string", b"").decode()

        async def content() -> Any:  # the chunks as they came, never joined into a second copy
            for chunk in chunks:
                yield chunk

        held = size
        try:
            request = state["client"].build_request(
                "POST", scope["path"] + (f"?{query}" if query else ""), content=content(), headers=headers
            )
            response = await state["client"].send(request, stream=True)
            try:
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and not occupancy.reserve(int(declared)):
                    await reply(send, 503, b"proxy busy: too many bytes in flight\n", busy)
                    return
                held += int(declared) if declared.isdigit() else 0
                parts = []
                async for part in response.aiter_raw():
                    if not declared.isdigit():
                        if not occupancy.reserve(len(part)):
                            await reply(send, 503, b"proxy busy: too many bytes in flight\n", busy)
                            return
                        held += len(part)
                    parts.append(part)
            finally:
                await response.aclose()
            chunks.clear()
            out = [(k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() not in _HOP]
            await reply(send, response.status_code, b"".join(parts), out)
        except httpx.HTTPError as e:
            await reply(send, 502, f"SuperLink unreachable: {type(e).__name__}\n".encode())
        finally:
            occupancy.release(held)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["client"] = httpx.AsyncClient(base_url=upstream, verify=verify, timeout=timeout)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await state["client"].aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] != "POST" or not path.startswith(FLEET_PREFIX) or ".." in path:
            await reply(
                send, 404, b"not found: this address serves only the Fleet API\n", [(b"content-type", b"text/plain")]
            )
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limits.max_body:  # refused before a byte of it is read
            await reply(send, 413, b"request body too large\n", close)
            return
        received = await body(receive, send)
        if received is None:
            return
        loop = asyncio.get_running_loop()
        occupancy.forwarding(scope.get("client"), True, loop.time())
        try:
            await forward(scope, *received, send)
        finally:
            occupancy.forwarding(scope.get("client"), False, loop.time())

    return app


def bounded_protocol(limits: Limits | None = None, occupancy: Occupancy | None = None) -> type:
    """uvicorn's h11 protocol with a header timeout and the connection caps of :class:`Occupancy` (uvicorn
    has neither: its keep-alive timer is reset by every byte, so a client sending a header byte at a time stays)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    held = occupancy or Occupancy(limits or Limits())
    timeout = held.limits.header_timeout

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._timed: object = None
            self._header_timer: Any = None
            if not held.admit(self, self.client, self.loop.time()):
                transport.abort()
                return
            self._start_header_timer()

        def _start_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._timed = self.cycle
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            if self.cycle is self._timed and not self.transport.is_closing():  # no request began since
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._timed and self._header_timer is not None:  # a request's headers arrived
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            import h11

            unread = self.conn.their_state is not h11.DONE  # a refused body: the rest is never read
            super().on_response_complete()
            if unread:  # TLS shutdown would read (and drop) the rest of it: cut the connection once the reply left
                self.loop.call_later(0.2, self.transport.abort)
            elif not self.transport.is_closing():  # the next request's headers are timed too
                self._start_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            held.leave(self)
            super().connection_lost(exc)

    return BoundedH11Protocol


def main(argv: list[str]) -> int:
    """``fedpers deploy fleet-proxy --listen HOST:PORT --superlink 127.0.0.1:PORT --ssl-certfile ...``."""
    import uvicorn

    from fedpers.deploy.isolation import reexec_isolated

    parser = argparse.ArgumentParser(prog="fedpers deploy fleet-proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT SuperNodes connect to (the network address)")
    parser.add_argument(
        "--superlink",
        required=True,
        help="the SuperLink's loopback HOST:PORT (fedpers deploy superlink --host 127.0.0.1 --port)",
    )
    parser.add_argument("--ssl-certfile", required=True, help="the SuperLink's TLS certificate (superlink.crt)")
    parser.add_argument("--ssl-keyfile", required=True, help="its private key (superlink.key)")
    parser.add_argument(
        "--ssl-ca-certfile", required=True, help="the lab's CA certificate (ca.crt): checks the loopback SuperLink"
    )
    defaults = Limits()
    parser.add_argument("--max-body-mib", type=float, default=MAX_BODY / 2**20, help="largest request body (MiB)")
    parser.add_argument(
        "--header-timeout", type=float, default=HEADER_TIMEOUT, help="seconds a connection may take to send its headers"
    )
    parser.add_argument(
        "--body-grace",
        type=float,
        default=BODY_GRACE,
        help="seconds a body may take before --min-body-rate-kib applies",
    )
    parser.add_argument(
        "--min-body-rate-kib",
        type=float,
        default=MIN_BODY_RATE / 1024,
        help="KiB/s a body must average after the grace",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open connections at most (the longest waiting yields)",
    )
    parser.add_argument(
        "--max-per-address", type=int, default=MAX_PER_ADDRESS, help="open connections per client address (IPv6: /64)"
    )
    parser.add_argument(
        "--max-buffered-mib", type=float, default=MAX_BUFFERED / 2**20, help="MiB of bodies and responses held at once"
    )
    args = parser.parse_args(argv)
    try:
        limits = Limits(
            max_body=int(args.max_body_mib * 2**20),
            header_timeout=args.header_timeout,
            body_grace=args.body_grace,
            min_body_rate=args.min_body_rate_kib * 1024,
            max_connections=args.max_connections,
            max_per_address=args.max_per_address,
            max_buffered=int(args.max_buffered_mib * 2**20),
        )
    except ValueError as e:  # the field's flag: max_body → --max-body-mib, min_body_rate → --min-body-rate-kib, ...
        flags = {"max_body": "--max-body-mib (bytes)", "min_body_rate": "--min-body-rate-kib (bytes/s)"}
        flags["max_buffered"] = f"--max-buffered-mib (bytes; at least the body limit, {defaults.max_body:d} by default)"
        field = str(e).split()[0]
        raise SystemExit(f"{flags.get(field, '--' + field.replace('_', '-'))}: {e}") from None
    host, _, port = args.listen.rpartition(":")
    up_host, _, up_port = args.superlink.rpartition(":")
    if not host or not port.isdigit() or not up_port.isdigit():
        raise SystemExit(f"--listen and --superlink must be HOST:PORT; got {args.listen!r}, {args.superlink!r}")
    if up_host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise SystemExit(
            f"--superlink must be a loopback address (the SuperLink's Control API stays off the network); got {up_host!r}"
        )
    reexec_isolated(["fedpers", "deploy", "fleet-proxy", *argv])
    import asyncio.sslproto

    asyncio.sslproto.SSLProtocol.max_size = TLS_READ_BUFFER  # per connection, allocated when it is made
    occupancy = Occupancy(limits)
    app = make_app(f"https://{up_host}:{up_port}", args.ssl_ca_certfile, limits=limits, occupancy=occupancy)
    print(
        f"fedpers fleet-proxy: at most {limits.max_connections} connections ({limits.max_per_address} per address), "
        f"{limits.max_buffered / 2**20:g} MiB of bodies and responses, {limits.bound() / 2**20:g} MiB buffered in all",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        app,
        http=bounded_protocol(limits, occupancy),
        timeout_keep_alive=int(max(1, min(limits.header_timeout, 5))),
        host=host.strip("[]"),
        port=int(port),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        log_level="warning",
        lifespan="on",
        loop="asyncio",  # asyncio's TLS (its read buffer is TLS_READ_BUFFER); uvloop's allocates 256 KiB a connection
        timeout_graceful_shutdown=5,  # SIGTERM: requests in flight get 5 s, then every connection is cut
    )
    return 0
