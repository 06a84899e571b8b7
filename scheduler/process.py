"""`python -m scheduler`'s process: the worker, the engine loop and the gRPC service wired together, the address
it registers in Redis, and SIGTERM's drain (finish what is in flight, take nothing new, then exit).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from base.cluster_auth import ClusterTokenCheck
from base.config import EngineConfig, lora_module
from base.errors import StatusError
from base.grpc_options import GRPC_OPTIONS
from base.telemetry import setup_tracing
from protos import scheduler_pb2_grpc
from protos.registration import SchedulerInfo
from scheduler.engine_loop import EngineLoop
from scheduler.grpc_service import SchedulerService
from scheduler.kv_transfer import KvPulls, KvServer, KvTransferCounters
from scheduler.options import ServeOptions
from scheduler.presence import Registry, current_registration
from scheduler.scheduler_telemetry import Reporting
from scheduler.stall_watch import StallWatch
from scheduler.worker_process import WorkerProcess

log = logging.getLogger(__name__)


def reachable_ip() -> str:
    """This host's address as its peers see it (in compose: the container's IP on the network)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def advertised_address(options: ServeOptions, port: int) -> str:
    """What the scheduler registers in Redis: --advertise-host (in Kubernetes, the pod IP), else the bound host."""
    host = options.advertise_host or options.host
    if host in ("0.0.0.0", "::", ""):
        host = reachable_ip()
    if ":" in host and not host.startswith("["):   # an IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


async def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or until the worker fails (1)."""
    config.validate()
    worker = WorkerProcess()
    tracing = setup_tracing("ferry-scheduler")
    reporting = readiness = watching = loop = None
    try:
        info = await worker.start(config)
        loop = EngineLoop(config, worker, info, tracing, options.limits)
        await load_lora_modules(loop, config.lora_modules)
        scheduler_id = options.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        counters = KvTransferCounters()
        loop.kv_server = KvServer(loop, counters)
        loop.kv_pulls = KvPulls(loop, scheduler_id, options.cluster_token, options.tls, counters)
        server, health_servicer, port = await start_grpc(loop, scheduler_id, options)
        address = advertised_address(options, port)
        reporting = await Reporting.start(loop.telemetry.metrics, loop.load, options.host, options.metrics_port,
                                          options.log_stats_interval)
        model = info.model
        identity = SchedulerInfo(scheduler_id, address, model.model_name, model.model_path, model.block_size,
                                 model.max_model_len, model.vocab_size, config.hash_seed, role=options.role,
                                 model_aliases=config.served_model_name[1:])
        watch = StallWatch(loop.stalled_seconds, health_servicer, config.stall_timeout)
        registry = start_registry(loop, options, identity, serving_fn=lambda: not watch.stalled)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        readiness = asyncio.create_task(report_ready(health_servicer, registry))
        watching = asyncio.create_task(watch.run())
        print(f"scheduler {scheduler_id} serving {model.model_name} on {address} "
              f"({model.num_blocks} blocks of {model.block_size})", flush=True)
        await run_until_signalled(loop, server, health_servicer, registry, options.drain_timeout)
        return 1 if loop.failure else 0
    finally:
        for task in (readiness, watching):
            if task is not None:
                task.cancel()
        if reporting is not None:
            await reporting.stop()
        if loop is not None and loop.kv_pulls is not None:
            await loop.kv_pulls.close()
        await worker.stop()   # the loop restarts workers in place: this is always the current one
        tracing.shutdown()


async def load_lora_modules(loop: EngineLoop, modules: list[str]) -> None:
    """--lora-modules, loaded before the scheduler serves; SystemExit naming the adapter that is refused."""
    for module in modules:
        name, path = lora_module(module)
        try:
            await loop.load_adapter(name, path)
        except StatusError as e:
            raise SystemExit(f"--lora-modules {name}={path}: {e.message}") from None


async def start_grpc(loop: EngineLoop, scheduler_id: str, options: ServeOptions
                     ) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=token_check(options))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(loop, scheduler_id), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_port(server, options)
    await server.start()
    return server, health_servicer, port


def start_registry(loop: EngineLoop, options: ServeOptions, identity: SchedulerInfo,
                   serving_fn: Callable[[], bool]) -> Registry | None:
    """Heartbeats carrying identity and the loop's current load and LoRA adapters while serving_fn() says so, and
    the loop's KV events; None without Redis."""
    if not options.redis_url:
        return None
    registry = Registry(options.redis_url, lambda: current_registration(identity, loop.scheduler.stats()),
                        ttl=options.heartbeat_ttl, password=options.redis_password,
                        held_fn=lambda: loop.scheduler.block_manager.published_hashes(), serving_fn=serving_fn,
                        cluster_token=options.cluster_token)
    loop.on_kv_events = registry.push_kv_events
    registry.start()
    return registry


def token_check(options: ServeOptions) -> list[grpc.aio.ServerInterceptor]:
    if options.cluster_token:
        return [ClusterTokenCheck(options.cluster_token)]
    if options.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no --cluster-token: anyone who reaches %s:%s can submit, abort and read requests",
                    options.host, options.port)
    return []


def add_port(server: grpc.aio.Server, options: ServeOptions) -> int:
    address = f"{options.host}:{options.port}"
    if options.tls.serving:
        return server.add_secure_port(address, options.tls.server_credentials(require_client_cert=bool(options.tls.ca)))
    return server.add_insecure_port(address)


async def report_ready(health_servicer: health.aio.HealthServicer, registry: Registry | None) -> None:
    """`ferry.Scheduler` turns SERVING once routers can find this scheduler: the model is loaded (the server only
    starts then) and the first registration is in Redis. A readiness probe asks for it; "" is SERVING already."""
    if registry is not None:
        await registry.registered.wait()
    await health_servicer.set("ferry.Scheduler", health_pb2.HealthCheckResponse.SERVING)


async def run_until_signalled(loop: EngineLoop, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                              registry: Registry | None, drain_timeout: float) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    loop_task = asyncio.create_task(loop.run())
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait([loop_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
    loop.draining = True
    await health_servicer.enter_graceful_shutdown()
    if registry:
        await registry.close()        # routers stop choosing this scheduler
    if not loop_task.done():
        await drain(loop, drain_timeout)
    await server.stop(grace=1)        # the last messages (and failures) reach their streams
    loop_task.cancel()


async def drain(loop: EngineLoop, timeout: float) -> None:
    """Finish the in-flight requests; those still running after `timeout` fail with UNAVAILABLE."""
    deadline = asyncio.get_running_loop().time() + timeout
    if loop.streams:
        log.warning("draining %d in-flight requests (up to %.0fs)", len(loop.streams), timeout)
    while loop.streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if loop.streams:
        loop.fail_streams(f"the scheduler shut down before the request finished (drain timeout {timeout:.0f}s)")
