"""The scheduler as an asyncio gRPC service: the continuous-batching loop around scheduler.core.Scheduler.

Each iteration: schedule → worker.Step (its own process, over a unix socket) → update → every RequestOutput goes
to its request's stream at once. A stream that goes away aborts its request before the next schedule().
Two ways in: Generate, one server stream per request; and Connect, one bidirectional stream per router that
carries many requests and sends each step's outputs for all of them as one message (gRPC's cost is per message).
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.context import Context

from base.cluster_auth import ClusterTokenCheck
from base.config import DRAIN_TIMEOUT_S, EngineConfig
from ferry.engine import init_request
from base.sampling_params import SamplingParams
from base.telemetry import TRACING_OFF, Tracing, extract_metadata, setup_tracing
from base.tls import TlsConfig
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler.admission import AdmissionLimits, QueueFull
from scheduler.core import RequestOutput, Scheduler
from scheduler.metrics import Reporting, SchedulerMetrics, SchedulerTelemetry
from scheduler.registry import Registry, SchedulerInfo

log = logging.getLogger(__name__)
FINISH_REASONS = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "length": common_pb2.FINISH_REASON_LENGTH,
                  "stop": common_pb2.FINISH_REASON_STOP, "abort": common_pb2.FINISH_REASON_ABORT}
GRPC_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
WORKER_START_TIMEOUT_S = 300.0


class WorkerFailed(Exception):
    pass


class Draining(Exception):
    """The scheduler got SIGTERM: it finishes what it holds and takes nothing new."""


class WorkerProcess:
    """The co-located worker: a child process serving gpu_worker on a unix socket in a private temp dir."""

    def __init__(self) -> None:
        self.dir = ""
        self.process: subprocess.Popen | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: worker_pb2_grpc.WorkerStub | None = None

    async def start(self, config: EngineConfig) -> worker_pb2.InitResponse:
        self.dir = tempfile.mkdtemp(prefix="ferry-worker-")
        self.socket_path = os.path.join(self.dir, "worker.sock")
        self.process = subprocess.Popen([sys.executable, "-m", "gpu_worker", "--socket", self.socket_path,
                                         "--parent-pid", str(os.getpid())])
        self.channel = grpc.aio.insecure_channel(f"unix:{self.socket_path}", options=GRPC_OPTIONS)
        await self.wait_until_serving()
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        return await self.stub.Init(init_request(config))

    async def wait_until_serving(self) -> None:
        health_stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = asyncio.get_running_loop().time() + WORKER_START_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            if self.process.poll() is not None:
                raise WorkerFailed(f"worker exited with code {self.process.returncode} while starting")
            try:
                await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        raise WorkerFailed("worker did not start in time")

    async def step(self, step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        try:
            return await self.stub.Step(step)
        except grpc.aio.AioRpcError as e:
            raise WorkerFailed(f"worker step failed: {e.code().name}: {e.details()}") from e

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


ABORTED = None   # queued on a stream whose request was aborted through Scheduler.Abort


@dataclass(eq=False)
class RequestStream:
    """Where the loop hands one request's outputs: a queue of (stream, RequestOutput | ABORTED | Exception), the
    request's own (Generate) or one shared by every request of a Connect stream."""
    request_id: str
    num_samples: int
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set[int] = field(default_factory=set)   # sample indexes whose last response was made
    sent_first: bool = False

    def put(self, item: RequestOutput | Exception | None) -> None:
        self.outputs.put_nowait((self, item))

    @property
    def done(self) -> bool:
        return len(self.finished) == self.num_samples


class EngineLoop:
    """Owns the core Scheduler and its worker; the only code that calls schedule/update."""

    def __init__(self, config: EngineConfig, worker: WorkerProcess, info: worker_pb2.InitResponse,
                 tracing: Tracing = TRACING_OFF, limits: AdmissionLimits = AdmissionLimits()):
        self.config = config
        self.limits = limits
        self.draining = False
        self.worker = worker
        self.info = info
        self.scheduler = self.new_scheduler()
        self.streams: dict[str, RequestStream] = {}
        self.wakeup = asyncio.Event()
        self.on_kv_events = lambda stored, removed: None
        self.failure: str | None = None
        metrics = SchedulerMetrics(self.load, info.model_name, dict(info.device_info))
        self.telemetry = SchedulerTelemetry(metrics, tracing)

    def new_scheduler(self) -> Scheduler:
        info = self.info
        return Scheduler(self.config, info.num_blocks, info.block_size, info.max_model_len,
                         list(info.eos_token_ids), info.model_name, info.sliding_window)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    trace_parent: Context | None = None, outputs: asyncio.Queue | None = None) -> RequestStream:
        if self.draining:
            raise Draining("the scheduler is shutting down")
        if self.failure:
            raise WorkerFailed(self.failure)
        if any(t >= self.info.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.info.vocab_size})")
        self.limits.check(self.scheduler, len(prompt_token_ids))
        self.scheduler.add_request(request_id, prompt_token_ids, params)
        self.telemetry.on_arrival(request_id, len(prompt_token_ids), params.n, trace_parent)
        stream = RequestStream(request_id, params.n, outputs if outputs is not None else asyncio.Queue())
        self.streams[request_id] = stream
        self.wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.put(ABORTED)
        self.telemetry.on_abort(request_id)
        return self.scheduler.abort_request(request_id)

    async def run(self) -> None:
        """Step until cancelled; a failed worker fails the in-flight requests and is restarted once per failure."""
        while True:
            try:
                await self.run_steps()
            except WorkerFailed as e:
                self.fail_everything(str(e))
            try:
                await self.restart_worker()
            except (WorkerFailed, grpc.aio.AioRpcError) as e:
                self.failure = f"worker could not be restarted: {e}"
                log.error(self.failure)
                return

    async def run_steps(self) -> None:
        in_flight: tuple[worker_pb2.StepRequest, asyncio.Future] | None = None
        try:
            while True:
                if in_flight is None:
                    step = self.scheduler.schedule()
                    if step is None:
                        await self.wait_for_work()
                        continue
                    in_flight = self.send(step)
                step, pending = in_flight
                outputs = self.scheduler.update(step, await pending)
                # the next step goes to the worker before the streams are served: the worker never waits for them
                following = self.scheduler.schedule()
                in_flight = self.send(following) if following is not None else None
                self.telemetry.on_outputs(outputs)
                self.deliver(outputs)
                self.on_kv_events(*self.scheduler.drain_kv_events())
        finally:
            if in_flight is not None:
                in_flight[1].cancel()

    def send(self, step: worker_pb2.StepRequest) -> tuple[worker_pb2.StepRequest, asyncio.Future]:
        self.telemetry.on_step(step)
        return step, asyncio.ensure_future(self.worker.step(step))

    async def restart_worker(self) -> None:
        log.warning("restarting the worker")
        await self.worker.stop()
        self.info = await self.worker.start(self.config)
        self.forget_cached_blocks()
        old = self.scheduler
        self.scheduler = self.new_scheduler()     # the new worker holds no sequences and an empty pool
        self.scheduler.counters = old.counters    # cumulative metrics must not go backwards
        self.scheduler.block_manager.counters = old.block_manager.counters
        self.failure = None
        log.warning("worker restarted")

    async def wait_for_work(self) -> None:
        self.wakeup.clear()
        if self.scheduler.has_unfinished_requests():
            await asyncio.sleep(0.001)   # e.g. only freed ids pending: look again soon
        else:
            await self.wakeup.wait()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def forget_cached_blocks(self) -> None:
        """The old pool's blocks are gone: withdraw them from the prefix index (after its pending events)."""
        self.on_kv_events(*self.scheduler.drain_kv_events())
        self.on_kv_events([], list(self.scheduler.block_manager.cached))

    def fail_everything(self, reason: str) -> None:
        log.error("%s; failing %d in-flight requests", reason, len(self.streams))
        self.failure = reason
        self.fail_streams(reason)

    def fail_streams(self, reason: str) -> None:
        for request_id, stream in list(self.streams.items()):
            stream.put(WorkerFailed(reason))
            self.telemetry.on_abort(request_id)
            self.scheduler.abort_request(request_id)
        self.streams.clear()

    def load(self) -> scheduler_pb2.StatsResponse:
        return self.scheduler.stats()


def to_response(out: RequestOutput, first: bool) -> scheduler_pb2.ScheduleResponse:
    response = scheduler_pb2.ScheduleResponse(index=out.index, token_ids=out.new_token_ids,
                                              logprobs=out.new_logprobs,
                                              finish_reason=FINISH_REASONS[out.finish_reason])
    if out.stop_token_id is not None:
        response.stop_token_id = out.stop_token_id
    if first:
        response.num_prompt_tokens = out.num_prompt_tokens
        response.num_cached_tokens = out.num_cached_tokens
    return response


def responses_for(stream: RequestStream, item: RequestOutput | None) -> list[scheduler_pb2.ScheduleResponse]:
    """What an output (or ABORTED) of the stream's request becomes on the wire; marks the samples it ends."""
    if item is ABORTED:
        unfinished = sorted(set(range(stream.num_samples)) - stream.finished)
        stream.finished.update(unfinished)
        return [scheduler_pb2.ScheduleResponse(index=index, finish_reason=FINISH_REASONS["abort"])
                for index in unfinished]
    response = to_response(item, not stream.sent_first)
    stream.sent_first = True
    if item.finish_reason is not None:
        stream.finished.add(item.index)
    return [response]


class Refused(Exception):
    """A request the scheduler did not take (or could not finish), with the gRPC status that says why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def admit(loop: EngineLoop, request_id: str, request: scheduler_pb2.ScheduleRequest, trace_parent: Context | None,
          outputs: asyncio.Queue | None = None) -> RequestStream:
    try:
        params = SamplingParams.from_proto(request.sampling)
        return loop.add_request(request_id, list(request.prompt_token_ids), params, trace_parent, outputs)
    except ValueError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
    except QueueFull as e:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
    except (WorkerFailed, Draining) as e:
        raise Refused(grpc.StatusCode.UNAVAILABLE, str(e)) from e


CLIENT_DONE = object()   # queued on a connection when its client sent its last message


class Connection:
    """The requests of one Connect stream. Their outputs share one queue, so everything the loop delivered in a
    step (and whatever piled up while the last message was being written) goes out as one ConnectResponse."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.live: dict[str, RequestStream] = {}
        self.client_done = False

    async def read(self, messages: AsyncIterator[scheduler_pb2.ConnectRequest]) -> None:
        try:
            async for message in messages:
                if message.HasField("submit"):
                    self.submit(message.submit)
                elif message.HasField("abort"):
                    self.abort(message.abort.request_id)
        finally:
            self.outputs.put_nowait((None, CLIENT_DONE))

    def submit(self, submit: scheduler_pb2.SubmitRequest) -> None:
        request_id = submit.request.request_id
        try:
            if not request_id:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a request on a Connect stream needs a request_id")
            if request_id in self.live:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request_id!r} is already in use")
            trace_parent = extract_metadata(submit.trace_context.items())
            self.live[request_id] = admit(self.loop, request_id, submit.request, trace_parent, self.outputs)
        except Refused as e:
            RequestStream(request_id, 0, self.outputs).put(e)   # a stream of its own: never live here

    def abort(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.loop.abort(request_id)

    def close(self) -> None:
        """The stream is gone: nobody reads what its requests would produce."""
        for request_id in list(self.live):
            self.abort(request_id)

    @property
    def ended(self) -> bool:
        return self.client_done and not self.live

    async def next_message(self) -> scheduler_pb2.ConnectResponse:
        message = scheduler_pb2.ConnectResponse()
        self.add_events(message, *await self.outputs.get())
        while not self.outputs.empty():
            self.add_events(message, *self.outputs.get_nowait())
        return message

    def add_events(self, message: scheduler_pb2.ConnectResponse, stream: RequestStream | None, item) -> None:
        if item is CLIENT_DONE:
            self.client_done = True
        elif isinstance(item, Exception):
            code, reason = ((item.code, item.message) if isinstance(item, Refused)
                            else (grpc.StatusCode.UNAVAILABLE, str(item)))
            message.events.add(request_id=stream.request_id,
                               error=scheduler_pb2.RequestFailure(code=code.value[0], message=reason))
            self.forget(stream)
        elif self.live.get(stream.request_id) is stream:   # else aborted by this client: nothing more goes out
            for response in responses_for(stream, item):
                message.events.add(request_id=stream.request_id, output=response)
            if stream.done:
                self.forget(stream)

    def forget(self, stream: RequestStream) -> None:
        if self.live.get(stream.request_id) is stream:
            del self.live[stream.request_id]
            self.loop.streams.pop(stream.request_id, None)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop, scheduler_id: str):
        self.loop = loop
        self.scheduler_id = scheduler_id

    async def Generate(self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            stream = admit(self.loop, request_id, request, extract_metadata(context.invocation_metadata()))
        except Refused as e:
            await context.abort(e.code, e.message)
        try:
            while not stream.done:
                _, item = await stream.outputs.get()
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                for response in responses_for(stream, item):
                    yield response
        finally:
            if not stream.done:   # the caller went away (or a stop string matched upstream)
                self.loop.abort(request_id)
            self.loop.streams.pop(request_id, None)

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                      context: grpc.aio.ServicerContext):
        connection = Connection(self.loop)
        reader = asyncio.create_task(connection.read(request_iterator))
        try:
            while not connection.ended:
                message = await connection.next_message()
                if message.events:
                    yield message
        finally:
            reader.cancel()
            connection.close()

    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(found=self.loop.abort(request.request_id))

    async def Stats(self, request: scheduler_pb2.StatsRequest, context) -> scheduler_pb2.StatsResponse:
        stats = self.loop.load()
        stats.scheduler_id = self.scheduler_id
        return stats


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    redis_url: str = ""
    scheduler_id: str = ""
    heartbeat_ttl: float = 3.0
    metrics_port: int = 0             # 0: no /metrics endpoint
    log_stats_interval: float = 10.0  # seconds between stats lines; 0: none
    limits: AdmissionLimits = AdmissionLimits()
    drain_timeout: float = DRAIN_TIMEOUT_S   # SIGTERM: seconds to finish in-flight requests before failing them
    cluster_token: str = ""           # callers of the Scheduler service must present it; "": anyone may call
    redis_password: str = ""
    tls: TlsConfig = TlsConfig()      # cert: TLS on the gRPC port; ca too: callers need a certificate it signed


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
    reporting = readiness = None
    try:
        info = await worker.start(config)
        loop = EngineLoop(config, worker, info, tracing, options.limits)
        scheduler_id = options.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=token_check(options))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(loop, scheduler_id), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = add_port(server, options)
        await server.start()
        address = advertised_address(options, port)
        reporting = await Reporting.start(loop.telemetry.metrics, loop.load, options.host, options.metrics_port,
                                          options.log_stats_interval)

        def registration() -> SchedulerInfo:
            stats = loop.scheduler.stats()
            return SchedulerInfo(scheduler_id, address, info.model_name, info.model_path, info.block_size,
                                 info.max_model_len, info.vocab_size, config.hash_seed, stats.num_waiting,
                                 stats.num_running, stats.waiting_tokens, stats.running_tokens)

        registry = (Registry(options.redis_url, registration, ttl=options.heartbeat_ttl,
                             password=options.redis_password) if options.redis_url else None)
        if registry:
            loop.on_kv_events = registry.push_kv_events
            registry.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        readiness = asyncio.create_task(report_ready(health_servicer, registry))
        print(f"scheduler {scheduler_id} serving {info.model_name} on {address} "
              f"({info.num_blocks} blocks of {info.block_size})", flush=True)
        await run_until_signalled(loop, server, health_servicer, registry, options.drain_timeout)
        return 1 if loop.failure else 0
    finally:
        if readiness is not None:
            readiness.cancel()
        if reporting is not None:
            await reporting.stop()
        await worker.stop()   # the loop restarts workers in place: this is always the current one
        tracing.shutdown()


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
    import signal

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
