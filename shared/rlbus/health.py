"""Readiness and liveness over HTTP, for an orchestrator's probes (Kubernetes, Compose).

A service with ``health_port`` or ``health_socket`` set serves two paths, on a TCP port and/or
a unix socket, from its own event loop (asyncio's server, no web framework):

- ``GET /ready``: 200 once setup is done and the main loop runs, 503 while the service starts
  (connects, loads a model) and again from the moment it is asked to stop (while it drains),
  so a load balancer or a rollout stops counting on it before it goes.
- ``GET /live``: 200 whenever the event loop answers; it stays 200 while draining, so a
  drain is never mistaken for a hang and killed. A loop blocked for longer than the probe's
  timeout fails it.

The unix socket is for pods on the host network (``hostNetwork``), where every replica on a
node would want the same port: the socket lives in the container's own filesystem. The probe
side is this module run as a program, reading the same variables as the service::

    python -m rlbus.health ready   # exit 0 on 200; RLBUS_HEALTH_SOCKET or RLBUS_HEALTH_PORT

Imports nothing of rlbus and nothing outside the standard library, so a probe starts fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

MAX_REQUEST_BYTES = 4096
"""A probe's request is one short line and a few headers; more is refused."""
READ_TIMEOUT_S = 5.0


class HealthServer:
    """Answers ``/ready`` from ``is_ready()`` and ``/live`` with 200 while the loop runs."""

    def __init__(self, is_ready: Callable[[], bool]) -> None:
        self.is_ready = is_ready
        self._servers: list[asyncio.Server] = []

    async def start(
        self, *, port: int | None = None, host: str = "0.0.0.0", socket: Path | None = None
    ) -> None:
        if port is not None:
            self._servers.append(await asyncio.start_server(self._handle, host, port))
        if socket is not None:
            _remove_stale(socket)
            self._servers.append(await asyncio.start_unix_server(self._handle, str(socket)))

    @property
    def port(self) -> int | None:
        """The TCP port actually bound (``port=0`` picks a free one); None without TCP."""
        for server in self._servers:
            for sock in server.sockets:
                if sock.family.name in ("AF_INET", "AF_INET6"):
                    return int(sock.getsockname()[1])
        return None

    async def close(self) -> None:
        for server in self._servers:
            server.close()
            await server.wait_closed()
        self._servers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            status, body = self._answer(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, body = 400, "bad request"
        except ConnectionError:
            return
        payload = body.encode() + b"\n"
        writer.write(
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    def _answer(self, head: bytes) -> tuple[int, str]:
        if len(head) > MAX_REQUEST_BYTES:
            return 400, "request too long"
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.partition(" ")[0].split("?", 1)[0]
        if path not in ("/ready", "/live"):
            return 404, "not found: /ready or /live"
        if method not in ("GET", "HEAD"):
            return 405, "GET only"
        if path == "/live":
            return 200, "live"
        return (200, "ready") if self.is_ready() else (503, "not ready")


def _remove_stale(socket: Path) -> None:
    """A socket file left by a killed predecessor in the same container would refuse the bind."""
    socket.unlink(missing_ok=True)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


async def probe(
    path: str, *, port: int | None = None, host: str = "127.0.0.1", socket: Path | None = None,
    timeout_s: float = 3.0,
) -> int:
    """GET ``path`` from a health server; returns the HTTP status (0 when nothing answers)."""

    async def get() -> int:
        if socket is not None:
            reader, writer = await asyncio.open_unix_connection(str(socket))
        elif port is not None:
            reader, writer = await asyncio.open_connection(host, port)
        else:
            raise ValueError("probe needs a port or a socket")
        writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        await writer.drain()
        line = await reader.readline()
        writer.close()
        return int(line.split()[1])

    try:
        return await asyncio.wait_for(get(), timeout_s)
    except (OSError, TimeoutError, ValueError, IndexError):
        return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m rlbus.health ready|live``: exit 0 when the service answers 200."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ("ready", "live"):
        print("usage: python -m rlbus.health ready|live", file=sys.stderr)
        return 2
    socket = os.environ.get("RLBUS_HEALTH_SOCKET")
    port = os.environ.get("RLBUS_HEALTH_PORT")
    if not socket and not port:
        print("rlbus.health: set RLBUS_HEALTH_SOCKET or RLBUS_HEALTH_PORT", file=sys.stderr)
        return 2
    status = asyncio.run(probe(
        f"/{args[0]}", port=int(port) if port else None, socket=Path(socket) if socket else None
    ))
    print(status or "no answer")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
