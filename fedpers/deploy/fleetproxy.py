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
BODY_TIMEOUT = 60.0
"""Seconds a request's whole body may take to arrive."""
MAX_CONNECTIONS = 512
"""Open connections beyond this are closed at once (a SuperNode holds one or two)."""


def make_app(
    upstream: str,
    ca_file: str | None,
    *,
    timeout: float = 120.0,
    max_body: int = MAX_BODY,
    body_timeout: float = BODY_TIMEOUT,
) -> Any:
    """The ASGI application: Fleet API requests to ``upstream`` (``https://127.0.0.1:PORT``), others 404."""
    import httpx

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
        if not declared.isdigit() or int(declared) > max_body:  # refused before a byte of it is read
            await reply(send, 413, b"request body too large\n", [(b"connection", b"close")])
            return
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0.0))
            except TimeoutError:
                await reply(send, 408, b"request body too slow\n", [(b"connection", b"close")])
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_body:
                await reply(send, 413, b"request body too large\n", [(b"connection", b"close")])
                return
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.decode().lower() not in _HOP]
        query = scope.get("query_string", b"").decode()
        try:
            response = await state["client"].post(
                path + (f"?{query}" if query else ""), content=b"".join(chunks), headers=headers
            )
        except httpx.HTTPError as e:
            await reply(send, 502, f"SuperLink unreachable: {type(e).__name__}\n".encode())
            return
        out = [(k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() not in _HOP]
        await reply(send, response.status_code, response.content, out)

    return app


def bounded_protocol(header_timeout: float = HEADER_TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> type:
    """uvicorn's h11 protocol with a header timeout and a cap on open connections (uvicorn has neither:
    its keep-alive timer is reset by every byte, so a client sending a header byte at a time stays)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._timed: object = None
            self._header_timer: Any = None
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._start_header_timer()

        def _start_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._timed = self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

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
        help="the SuperLink's loopback HOST:PORT (flower-superlink --host 127.0.0.1 --port)",
    )
    parser.add_argument("--ssl-certfile", required=True, help="the SuperLink's TLS certificate (superlink.crt)")
    parser.add_argument("--ssl-keyfile", required=True, help="its private key (superlink.key)")
    parser.add_argument(
        "--ssl-ca-certfile", required=True, help="the lab's CA certificate (ca.crt): checks the loopback SuperLink"
    )
    parser.add_argument(
        "--max-body-mib", type=float, default=MAX_BODY / 2**20, help="largest request body forwarded (MiB)"
    )
    parser.add_argument(
        "--header-timeout", type=float, default=HEADER_TIMEOUT, help="seconds a connection may take to send its headers"
    )
    parser.add_argument(
        "--max-connections", type=int, default=MAX_CONNECTIONS, help="open connections beyond this are closed"
    )
    args = parser.parse_args(argv)
    if not 0 < args.max_body_mib <= 512 or not 0 < args.header_timeout <= 600 or not 1 <= args.max_connections:
        raise SystemExit("--max-body-mib must be in (0, 512], --header-timeout in (0, 600] s, --max-connections >= 1")
    host, _, port = args.listen.rpartition(":")
    up_host, _, up_port = args.superlink.rpartition(":")
    if not host or not port.isdigit() or not up_port.isdigit():
        raise SystemExit(f"--listen and --superlink must be HOST:PORT; got {args.listen!r}, {args.superlink!r}")
    if up_host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise SystemExit(
            f"--superlink must be a loopback address (the SuperLink's Control API stays off the network); got {up_host!r}"
        )
    reexec_isolated(["fedpers", "deploy", "fleet-proxy", *argv])
    app = make_app(f"https://{up_host}:{up_port}", args.ssl_ca_certfile, max_body=int(args.max_body_mib * 2**20))
    uvicorn.run(
        app,
        http=bounded_protocol(args.header_timeout, args.max_connections),
        timeout_keep_alive=int(max(1, min(args.header_timeout, 5))),
        host=host.strip("[]"),
        port=int(port),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        log_level="warning",
        lifespan="on",
    )
    return 0
