"""Serving the HTTP app inside the router's event loop: its flags, and uvicorn as one task beside the gRPC server."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from base.options import option
from base.tls import TlsConfig
from router.http.body import BODY_TIMEOUT_S


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP client may hold of the server, and for how long (slow clients: slowloris)."""
    # uvicorn's limit_concurrency; above the router's 4096 streams, whose 429 comes first
    max_connections: int = option(8192, "open HTTP connections (or requests in flight) past which requests get 503",
                                  flag="--http-max-connections")
    header_timeout: float = option(10.0, "seconds an HTTP client has to send a request's headers, from connecting "
                                         "or from its last response, before the connection is closed",
                                   flag="--http-header-timeout")
    body_timeout: float = option(BODY_TIMEOUT_S, "seconds an HTTP client has to send a request's body before it "
                                                 "gets 408", flag="--http-body-timeout")

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.header_timeout <= 0 or self.body_timeout <= 0:
            raise ValueError("--http-max-connections, --http-header-timeout and --http-body-timeout must be positive")


class HeaderDeadlineProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP protocol, which waits for a request's headers as long as they trickle in, with a deadline:
    a connection that has not sent a request's whole head within header_timeout of connecting, or of its last
    response, is closed."""

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def arm_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        self.header_deadline = self.loop.call_later(self.header_timeout, self.close_unless_request_since,
                                                    self.cycle)

    def close_unless_request_since(self, cycle: object) -> None:
        if self.cycle is cycle and not self.transport.is_closing():   # no new request's head came
            self.transport.close()


class EmbeddedServer(uvicorn.Server):
    """uvicorn as one task of a bigger asyncio program, which keeps its own signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class HttpServer:
    server: EmbeddedServer
    task: asyncio.Task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve_http(app: FastAPI, host: str, port: int, drain_timeout: float = 2.0,
                     tls: TlsConfig = TlsConfig(), reuse_port: bool = False,
                     limits: HttpLimits = HttpLimits()) -> HttpServer:
    """Start serving app on host:port in the running event loop (HTTPS with tls.cert); OSError if the port cannot
    be bound. With reuse_port, other processes may bind it too (SO_REUSEPORT) and the kernel shares connections."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:   # `--workers N`: the workers share the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    protocol = functools.partial(HeaderDeadlineProtocol, header_timeout=limits.header_timeout)
    server = EmbeddedServer(uvicorn.Config(app, log_level="warning", lifespan="off", http=protocol,
                                           limit_concurrency=limits.max_connections,
                                           timeout_graceful_shutdown=drain_timeout, **tls.uvicorn_options()))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
        raise OSError(f"HTTP server on {host}:{port} did not start")
    return HttpServer(server, task)
