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
MAX_BODY = 512 * 1024 * 1024
"""Largest request body forwarded (a SuperNode's reply object; Flower chunks large arrays)."""


def make_app(upstream: str, ca_file: str | None, *, timeout: float = 120.0) -> Any:
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
        chunks, size = [], 0
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY:
                await reply(send, 413, b"request body too large\n")
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


def main(argv: list[str]) -> int:
    """``fedpers deploy fleet-proxy --listen HOST:PORT --superlink 127.0.0.1:PORT --ssl-certfile ...``."""
    import uvicorn

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
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    up_host, _, up_port = args.superlink.rpartition(":")
    if not host or not port.isdigit() or not up_port.isdigit():
        raise SystemExit(f"--listen and --superlink must be HOST:PORT; got {args.listen!r}, {args.superlink!r}")
    if up_host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise SystemExit(
            f"--superlink must be a loopback address (the SuperLink's Control API stays off the network); got {up_host!r}"
        )
    app = make_app(f"https://{up_host}:{up_port}", args.ssl_ca_certfile)
    uvicorn.run(
        app,
        host=host.strip("[]"),
        port=int(port),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        log_level="warning",
        lifespan="on",
    )
    return 0
