"""The router's gRPC face: Router.Generate over router.core.Router, plus standard health checking."""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ferry.telemetry import extract_metadata, setup_tracing
from protos import router_pb2, router_pb2_grpc
from router.core import RequestError, Router
from router.discovery import SchedulerDirectory
from router.metrics import RouterTelemetry
from router.openai_api import create_app, directory_models, serve_http
from router.policy import POLICIES

log = logging.getLogger(__name__)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, api_key: str = ""):
        self.router = router
        self.api_key = api_key

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.api_key and not authorized(context.invocation_metadata(), self.api_key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key "
                                "(send metadata 'authorization: Bearer <key>')")
        try:
            async for response in self.router.generate(request, extract_metadata(context.invocation_metadata())):
                yield response
        except RequestError as e:
            await context.abort(e.code, e.message)


def authorized(metadata, api_key: str) -> bool:
    sent = dict(metadata or ()).get("authorization", "")
    return hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode())


@dataclass
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str = ""
    schedulers: list[str] = field(default_factory=list)
    model_path: str = ""
    policy: str = "cache_aware"
    http_host: str = "127.0.0.1"
    http_port: int = 0                  # 0: no HTTP
    api_key: str = ""


async def serve(options: RouterOptions) -> int:
    directory = SchedulerDirectory(options.redis_url, options.schedulers, options.model_path)
    await directory.start()
    tracing = setup_tracing("ferry-router")
    router = Router(directory, POLICIES[options.policy](), telemetry=RouterTelemetry(tracing=tracing))
    http = None
    if options.http_port:
        app = create_app(router.generate, models=directory_models(directory), api_key=options.api_key or None)
        router.telemetry.instrument(app)
        try:
            http = await serve_http(app, options.http_host, options.http_port)
        except OSError as e:
            await directory.close()
            raise SystemExit(f"router: cannot serve HTTP on {options.http_host}:{options.http_port}: {e}") from e
        print(f"router serving OpenAI HTTP on http://{options.http_host}:{options.http_port}/v1", flush=True)
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(RouterService(router, options.api_key), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{options.host}:{options.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("ferry.Router", health_pb2.HealthCheckResponse.SERVING)
    print(f"router serving gRPC on {options.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    if http is not None:
        await http.stop()
    await server.stop(grace=2)
    await directory.close()
    tracing.shutdown()
    return 0
