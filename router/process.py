"""The router's gRPC face: Router.Generate over router.core.Router, plus standard health checking."""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from base.telemetry import extract_metadata, setup_tracing
from protos import router_pb2, router_pb2_grpc
from router.api_keys import presented_key
from router.core import RequestError, Router
from router.discovery import SchedulerDirectory
from router.http.app import create_app
from router.http.body import MAX_REQUEST_BYTES
from router.http.errors import RETRY_AFTER_S
from router.http.http_server import HttpServer, serve_http
from router.http.served_models import directory_models
from router.lora_admin import LoraAdmin
from router.options import RouterOptions
from router.policy import POLICIES, CacheAwarePolicy, RoutingPolicy
from router.retry import RetryGovernor
from router.router_telemetry import RouterTelemetry
from router.shared_limits import key_limiter
from router.tenant_admission import TenantAdmission
from router.tenants import TENANT_HEADER, tenant_directory

log = logging.getLogger(__name__)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, api_keys: list[str] | None = None, max_request_bytes: int = MAX_REQUEST_BYTES):
        self.router = router
        self.api_keys = api_keys or []
        self.max_request_bytes = max_request_bytes

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        """The request arrives as bytes (see add_router_service) and is parsed here."""
        api_key = ""
        if self.api_keys:
            api_key = client_key(context.invocation_metadata(), self.api_keys)
            if api_key is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key "
                                    "(send metadata 'authorization: Bearer <key>')")
        if len(raw) > self.max_request_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request is {len(raw)} bytes; the limit is {self.max_request_bytes}")
        try:
            request = router_pb2.GenerateRequest.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"GenerateRequest does not parse: {e}")
        try:
            trace_parent = extract_metadata(context.invocation_metadata())
            tenant_header = str(dict(context.invocation_metadata() or ()).get(TENANT_HEADER, ""))
            async for response in self.router.generate(request, trace_parent, api_key=api_key,
                                                       tenant_header=tenant_header):
                yield response
        except RequestError as e:
            await context.abort(e.code, e.message, trailing_metadata=retry_after(e))


def add_router_service(service: RouterService, server: grpc.aio.Server) -> None:
    """The generated add_RouterServicer_to_server, except that Generate gets its request unparsed: a message protobuf
    cannot parse (a string field that is not UTF-8, which clients in other languages can send) is then
    INVALID_ARGUMENT with the reason, where grpc's own deserializer would answer UNKNOWN and log a traceback."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        service.Generate, response_serializer=router_pb2.GenerateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ferry.Router", handlers),))
    server.add_registered_method_handlers("ferry.Router", handlers)


def retry_after(error: RequestError) -> tuple[tuple[str, str], ...]:
    if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ()
    return (("retry-after", str(error.retry_after or RETRY_AFTER_S)),)


def grpc_server_options(max_request_bytes: int) -> list[tuple[str, int]]:
    """Messages up to twice the limit arrive and get a clear INVALID_ARGUMENT; larger ones grpc refuses unread
    (RESOURCE_EXHAUSTED, 'received message larger than max')."""
    return [("grpc.max_receive_message_length", 2 * max_request_bytes)]


def client_key(metadata, api_keys: list[str]) -> str | None:
    """The API key the call's `authorization: Bearer <key>` metadata carries, if it is one of api_keys."""
    return presented_key(api_keys, str(dict(metadata or ()).get("authorization", "")))


def routing_policy(options: RouterOptions) -> RoutingPolicy:
    """The policy --policy names, with the pull options where it weighs pulls (cache_aware)."""
    policy = POLICIES[options.policy]()
    if isinstance(policy, CacheAwarePolicy):
        policy.kv_pull = options.kv_pull
    return policy


async def serve(options: RouterOptions) -> int:
    directory = SchedulerDirectory(options.redis_url, options.schedulers, options.model_path,
                                   redis_password=options.redis_password, cluster_token=options.cluster_token,
                                   tls=options.tls, keepalive_s=options.scheduler_keepalive)
    await directory.start()
    tracing = setup_tracing("ferry-router")
    limiter = key_limiter(options.key_limits, options.redis_url, options.redis_password)
    tenants = tenant_directory(options.tenant_config, options.key_tenants, bool(options.api_keys))
    telemetry = RouterTelemetry(tracing=tracing)
    telemetry.metrics.tenants.named = frozenset(tenants.policies)
    router = Router(directory, routing_policy(options), telemetry=telemetry,
                    max_concurrent_requests=options.max_concurrent_requests, retries=RetryGovernor(options.retry),
                    stream_interval=options.stream_interval,
                    key_limiter=limiter, tenants=tenants,
                    tenant_admission=TenantAdmission(options.shed_queued_requests),
                    chat_templating=options.chat_templating(),
                    generation_config=options.sampling_defaults())
    http = None
    if options.http_port:
        http = await start_http(router, directory, options)
    server = grpc.aio.server(options=grpc_server_options(options.max_request_bytes))
    add_router_service(RouterService(router, options.api_keys, options.max_request_bytes), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_port(server, options)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("ferry.Router", health_pb2.HealthCheckResponse.SERVING)
    print(f"router serving gRPC on {options.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(server, http, health_servicer, options.drain_timeout)
    await limiter.close()
    await directory.close()
    tracing.shutdown()
    return 0


async def start_http(router: Router, directory: SchedulerDirectory, options: RouterOptions) -> HttpServer:
    app = create_app(router.generate, models=directory_models(directory, router.chat_templating),
                     api_keys=options.api_keys,
                     max_request_bytes=options.max_request_bytes, tool_call_parser=options.tool_call_parser,
                     body_timeout=options.http_limits.body_timeout, lora_admin=LoraAdmin(directory),
                     force_include_usage=options.enable_force_include_usage,
                     reasoning_parser=options.reasoning_parser)
    router.telemetry.instrument(app)
    try:
        http = await serve_http(app, options.http_host, options.http_port, options.drain_timeout, options.tls,
                                options.reuse_port, options.http_limits)
    except OSError as e:
        await directory.close()
        raise SystemExit(f"router: cannot serve HTTP on {options.http_host}:{options.http_port}: {e}") from e
    scheme = "https" if options.tls.serving else "http"
    print(f"router serving OpenAI HTTP on {scheme}://{options.http_host}:{options.http_port}/v1", flush=True)
    return http


def add_port(server: grpc.aio.Server, options: RouterOptions) -> int:
    address = f"{options.host}:{options.port}"
    if options.tls.serving:
        return server.add_secure_port(address, options.tls.server_credentials())
    return server.add_insecure_port(address)


async def drain(server: grpc.aio.Server, http: HttpServer | None, health_servicer: health.aio.HealthServicer,
                timeout: float) -> None:
    """SIGTERM: report NOT_SERVING, take no new calls, let the streams in flight finish (up to timeout)."""
    await health_servicer.enter_graceful_shutdown()
    stops = [server.stop(grace=timeout)] + ([http.stop()] if http is not None else [])
    await asyncio.gather(*stops)
