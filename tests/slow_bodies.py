"""A slow-body attacker on the fleet proxy (test tooling, run as its own process).

``python tests/slow_bodies.py PORT CA_FILE CONNECTIONS SECONDS REPORT_JSON [FIRST_BYTES]``: keeps
CONNECTIONS TLS connections open to 127.0.0.1:PORT for SECONDS (or until it is stopped), each from one of
CONNECTIONS/8 loopback addresses (127.0.8.1, 127.0.8.2, ...: 8 connections each, under any per-address
cap), each sending full headers of a 6 MiB ``push-object`` request (every other one FIRST_BYTES of its
body at once, default 0) and then 100 bytes a second; a connection the proxy cuts is opened again at
once. Writes what it managed to REPORT_JSON every second: connections opened, cut, open now and the
most open at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
import time

BODY = 6 * 1024 * 1024 - 4096  # just under the proxy's body limit: not refused from its Content-Length
HEAD = (
    b"POST /v1/fleet/push-object HTTP/1.1\r\nHost: x\r\nContent-Type: application/protobuf\r\nContent-Length: %d\r\n\r\n"
    % BODY
)


async def attacker(
    index: int, port: int, context: ssl.SSLContext, until: float, stats: dict[str, int], first: int
) -> None:
    source = f"127.0.8.{1 + index // 8}"
    while time.monotonic() < until:
        writer = None
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1", local_addr=(source, 0)
                ),
                10,
            )
            stats["opened"] += 1
            stats["open"] += 1
            stats["most_open"] = max(stats["most_open"], stats["open"])
            try:
                writer.write(HEAD + b"x" * (first if index % 2 == 0 else 0))
                await writer.drain()
                while time.monotonic() < until:
                    await asyncio.sleep(1.0)
                    if writer.transport.is_closing():
                        break
                    writer.write(b"x" * 100)
                    await writer.drain()
            finally:
                stats["open"] -= 1
        except (TimeoutError, OSError, ssl.SSLError):
            pass
        finally:
            if writer is not None:
                writer.transport.abort()
        if time.monotonic() < until:
            stats["cut"] += 1
            await asyncio.sleep(0.1)


async def main(port: int, ca: str, connections: int, seconds: float, report: str, first: int) -> None:
    context = ssl.create_default_context(cafile=ca)
    stats = {"opened": 0, "open": 0, "most_open": 0, "cut": 0}
    until = time.monotonic() + seconds

    async def write_report() -> None:
        while True:
            with open(report + ".tmp", "w") as f:
                json.dump(stats, f)
            os.replace(report + ".tmp", report)
            await asyncio.sleep(1.0)

    reporter = asyncio.create_task(write_report())
    await asyncio.gather(*(attacker(i, port, context, until, stats, first) for i in range(connections)))
    reporter.cancel()


if __name__ == "__main__":
    asyncio.run(
        main(
            int(sys.argv[1]),
            sys.argv[2],
            int(sys.argv[3]),
            float(sys.argv[4]),
            sys.argv[5],
            int(sys.argv[6]) if len(sys.argv) > 6 else 0,
        )
    )
