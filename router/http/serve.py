"""Serving the HTTP app inside the router's event loop: its flags, and uvicorn as one task beside the gRPC server."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from base.tls import TlsConfig


def add_http_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http-host", default="127.0.0.1", help="OpenAI-compatible HTTP host")
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port; 0: no HTTP")


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
                     tls: TlsConfig = TlsConfig()) -> HttpServer:
    """Start serving app on host:port in the running event loop (HTTPS with tls.cert); OSError if the port cannot
    be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    server = EmbeddedServer(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=drain_timeout, **tls.uvicorn_options()))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
        raise OSError(f"HTTP server on {host}:{port} did not start")
    return HttpServer(server, task)
