"""The continuous-batching loop around scheduler.core.Scheduler, and the streams it hands outputs to.

Each iteration: schedule → worker.Step (its own process, scheduler/worker_process.py) → update → every
RequestOutput goes to its request's stream at once. The next step is sent before the streams are served, so
the worker never waits for them; with async scheduling (the default) it is sent even before the running step's
result is in (scheduler/core.py says how). A failed worker is replaced, and its requests go on with the new one
(scheduler/crash_triage.py: a request that crashes every worker is found and failed alone).
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context

from base.config import EngineConfig
from base.errors import StatusError
from base.prompt_checks import check_token_ids
from base.sampling_params import SamplingParams
from base.telemetry import TRACING_OFF, Tracing
from protos import common_pb2, scheduler_pb2, worker_pb2
from scheduler.admission import AdmissionLimits
from scheduler.baselines import scheduler_for
from scheduler.core import RequestOutput, Scheduler
from scheduler.crash_triage import CrashTriage, Rejoining
from scheduler.lora_adapters import AdapterNotFound
from scheduler.scheduler_telemetry import SchedulerMetrics, SchedulerTelemetry
from scheduler.sequence import DEFAULT_TENANCY, Tenancy
from scheduler.worker_process import WorkerFailed, WorkerProcess

log = logging.getLogger(__name__)


class Draining(Exception):
    """The scheduler got SIGTERM: it finishes what it holds and takes nothing new."""


@dataclass(eq=False)
class RequestStream:
    """Where the loop hands one request's outputs: a queue of (stream, RequestOutput | Exception), shared by every
    request of a Connect stream (scheduler/grpc_service.py)."""
    request_id: str
    num_samples: int
    outputs: asyncio.Queue
    finished: set[int] = field(default_factory=set)   # sample indexes whose last response was made
    sent_first: bool = False

    def put(self, item: RequestOutput | Exception) -> None:
        self.outputs.put_nowait((self, item))

    @property
    def done(self) -> bool:
        return len(self.finished) == self.num_samples


CONTENDED_MEMORY_S = 10.0   # how long after its policy was last contended the loop still builds steps late


@dataclass
class BuildCost:
    """What the worker would wait, were each step built after the last one's result: the loop's time from a result
    to the next step sent (update and schedule), against the worker's time in a step; medians of the last `window`
    steps, so that one slow build (a first step's cold paths, a collection, the core lent elsewhere a moment) does not
    flip how steps are built for the many after it, as a moving average's long tail would."""
    window: int = 16
    small_share: float = 0.05    # of a step: what waiting for the build may cost the worker at most
    host_seconds: float = 0.0    # the medians, taken once a step as it is observed (small() is asked more often)
    busy_seconds: float = 0.0
    hosts: deque = field(default_factory=deque)
    busies: deque = field(default_factory=deque)

    def observe(self, host_seconds: float, busy_seconds: float) -> None:
        for seen, seconds in ((self.hosts, host_seconds), (self.busies, busy_seconds)):
            seen.append(seconds)
            if len(seen) > self.window:
                seen.popleft()
        self.host_seconds, self.busy_seconds = statistics.median(self.hosts), statistics.median(self.busies)

    def small(self) -> bool:
        return 0 < self.host_seconds <= self.small_share * self.busy_seconds


@dataclass
class InterruptAllowance:
    """Worker time the loop may throw away on steps cut short (EngineLoop.interrupt_for): refilled at `share` of
    the wall clock, holding at most `steps` of a step's usual time. Arrivals that outrank the work in hand one after
    another (two tenants flooding by turns) would otherwise cut every step and keep half of each."""
    share: float = 0.1
    steps: float = 2.0
    seconds: float = 0.0
    at: float = 0.0

    def take(self, cost: float, step_seconds: float, now: float) -> bool:
        self.seconds = min(self.steps * step_seconds, self.seconds + (now - self.at) * self.share)
        self.at = now
        if cost > self.seconds:
            return False
        self.seconds -= cost
        return True


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
        self.last_sent_step_id = 0   # the worker runs the steps in the order they were sent
        self.last_sent_at = 0.0      # and when (perf_counter)
        self.interrupted_step_id = 0  # the last step the worker was asked to cut short
        self.interrupt_allowance = InterruptAllowance()
        self.interrupting: asyncio.Future | None = None   # the last Interrupt call, held: asyncio holds weakly
        self.waiting_since: float | None = None   # when the loop began waiting on the worker (a step, a restart)
        self.build_cost = BuildCost()
        self.contended_at = -CONTENDED_MEMORY_S   # when the policy last ranked requests against each other
        self.triage = CrashTriage()
        self.restarting = False
        self.arrived: list[Rejoining] = []   # requests taken while the worker restarts
        self.kv_pulls = None                 # scheduler.kv_transfer.KvPulls where this scheduler pulls KV from peers
        self.kv_server = None                # and the KvServer that answers its peers
        metrics = SchedulerMetrics(self.load, info.model.model_name, dict(info.device_info),
                                   list(info.rank_weight_bytes))
        self.telemetry = SchedulerTelemetry(metrics, tracing)

    def new_scheduler(self) -> Scheduler:
        return scheduler_for(self.config, self.info.model)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    outputs: asyncio.Queue, trace_parent: Context | None = None,
                    resumed_token_ids: list[int] | None = None,
                    sampling: common_pb2.SamplingParams | None = None,
                    tenancy: Tenancy = DEFAULT_TENANCY, lora_name: str = "",
                    kv_source: scheduler_pb2.KvSource | None = None) -> RequestStream:
        """resumed_token_ids: what another scheduler generated for it before it died; sampling: the message params
        came from; tenancy: its tenant and priority; lora_name: its adapter (Scheduler.add_request); kv_source: a
        peer to pull its prefix's KV from first (scheduler/kv_transfer.py), where this loop pulls."""
        if self.draining:
            raise Draining("the scheduler is shutting down")
        if self.failure and not self.restarting:
            raise WorkerFailed(self.failure)
        check_token_ids(prompt_token_ids, self.info.model.vocab_size)
        if resumed_token_ids:
            check_token_ids(resumed_token_ids, self.info.model.vocab_size)
        self.scheduler.lora.check_requested(lora_name)
        self.limits.check(self.scheduler, len(prompt_token_ids))
        if self.restarting:   # taken, and handed to the new worker with those the old one had
            self.arrived.append(Rejoining(request_id, prompt_token_ids, params, resumed_token_ids or [], tenancy,
                                          lora_name))
        else:
            pull = self.pulls_from(kv_source)
            self.scheduler.add_request(request_id, prompt_token_ids, params, resumed_token_ids or [], sampling,
                                       tenancy, lora_name, held=pull)
            if request_id in self.scheduler.held:
                self.kv_pulls.start(request_id, kv_source)
            self.interrupt_for(request_id)
            self.on_kv_events(*self.scheduler.drain_kv_events())    # its announced blocks (--announce-prompts), now
        self.telemetry.on_arrival(request_id, len(prompt_token_ids), params.n, trace_parent, tenancy.tenant)
        stream = RequestStream(request_id, params.n, outputs)
        self.streams[request_id] = stream
        self.wakeup.set()
        return stream

    def interrupt_for(self, request_id: str) -> None:
        """A queued arrival that outranks work in the one step with the worker (steps built late: depth()) asks the
        worker to cut it short between two layers, where steps are long beside their build (a CPU's): the arrival
        then waits for a layer rather than the rest of the step, and the step's work is scheduled again after the
        arrival's own step (Scheduler.take_back). It costs that work the part of the step already done, at most a
        tenth of the worker's time (InterruptAllowance). However long the step has run, it is cut: steps vary (one
        after a newcomer's carries what sat that one out), and one past the usual time may be far from its end."""
        step_id = self.last_sent_step_id
        if step_id == self.interrupted_step_id or not self.build_cost.small():
            return
        seq = self.scheduler.requests[request_id].seqs[0]
        work = self.scheduler.interruptible(step_id)
        if seq not in self.scheduler.waiting or not work:
            return
        now, steps = time.perf_counter(), self.scheduler.counters.steps
        if (any(self.scheduler.policy.may_preempt_for(seq, running, steps) for running in work)
                and self.interrupt_allowance.take(now - self.last_sent_at, self.build_cost.busy_seconds, now)):
            self.interrupted_step_id = step_id
            self.interrupting = asyncio.ensure_future(self.worker.interrupt(step_id))

    def pulls_from(self, source: scheduler_pb2.KvSource | None) -> bool:
        return (source is not None and self.kv_pulls is not None and self.config.enable_prefix_caching
                and self.kv_pulls.wanted(source))

    def abort(self, request_id: str) -> None:
        """Drop the request: its blocks are freed now, and nothing more is delivered for it."""
        self.streams.pop(request_id, None)
        self.telemetry.on_abort(request_id)
        self.triage.drop(request_id)
        self.scheduler.abort_request(request_id)
        self.on_kv_events(*self.scheduler.drain_kv_events())    # a prompt announced, never computed, withdrawn

    async def run(self) -> None:
        """Step until cancelled; a failed worker is replaced and its requests rejoin the new one."""
        while True:
            suspects, live = set(), []
            try:
                await self.run_steps()
            except WorkerFailed as e:
                self.failure = str(e)
                suspects, live = self.in_flight_requests(), self.rejoining(str(e))
                log.error("%s; %d requests go on with a new worker, %d of them suspects", e, len(live), len(suspects))
            self.restarting = True
            try:
                await self.restart_worker()
            except (WorkerFailed, grpc.aio.AioRpcError) as e:
                self.failure = f"worker could not be restarted: {e}"
                log.error(self.failure)
                self.fail_streams(self.failure)
                return
            finally:
                self.restarting = False
            arrived, self.arrived = self.arrived, []
            self.rejoin(live + arrived, suspects)

    def in_flight_requests(self) -> set[str]:
        return {chunk.seq.request_id for chunks in self.scheduler.in_flight.values() for chunk in chunks}

    def rejoining(self, reason: str) -> list[Rejoining]:
        """The live requests as the new worker will take them; those of n > 1 samples (which cannot be resumed)
        fail with UNAVAILABLE, for the router to retry."""
        live = []
        for request_id, stream in list(self.streams.items()):
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue   # held since an earlier crash (CrashTriage.held)
            if request.params.n > 1:
                self.fail_stream(request_id, WorkerFailed(reason))
            else:
                live.append(Rejoining(request_id, request.prompt_token_ids, request.params,
                                      request.seqs[0].output_token_ids, request.tenancy, request.lora_name))
        return live

    def rejoin(self, live: list[Rejoining], suspects: set[str]) -> None:
        admitted, culprit = self.triage.split(live, suspects)
        if culprit is not None:
            log.error("request %s crashed the worker: failed alone", culprit.request_id)
            self.fail_stream(culprit.request_id, StatusError(
                grpc.StatusCode.INTERNAL, f"the worker crashed running this request ({self.failure}); it was the "
                "only one in the crashed steps, so it is failed rather than retried"))
        self.readmit(admitted)

    def readmit(self, rejoining: list[Rejoining]) -> None:
        if not rejoining:
            return
        for request in rejoining:
            if request.request_id not in self.streams:   # aborted while it waited
                continue
            try:
                self.scheduler.add_request(request.request_id, request.prompt, request.resumed_params(),
                                           request.generated, tenancy=request.tenancy, lora_name=request.lora_name)
            except (ValueError, AdapterNotFound) as e:
                self.fail_stream(request.request_id, StatusError(grpc.StatusCode.UNAVAILABLE, str(e)))
        self.wakeup.set()

    def generated_count(self, request_id: str) -> int | None:
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.seqs[0].num_output_tokens

    def fail_stream(self, request_id: str, error: Exception) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)
        self.telemetry.on_abort(request_id)

    async def run_steps(self) -> None:
        """Keep `depth()` steps with the worker."""
        in_flight: deque[tuple[worker_pb2.StepRequest, asyncio.Future]] = deque()
        try:
            while True:
                self.readmit(self.triage.release(self.generated_count))
                self.fill(in_flight, self.depth())
                if not in_flight:
                    await self.wait_for_work()
                    continue
                step, pending = in_flight.popleft()
                result = await self.wait_on_worker(pending)
                took_result = time.perf_counter()
                self.telemetry.on_result(result)
                outputs = self.scheduler.update(step, result)
                # the next step goes to the worker before the streams are served: the worker never waits for them
                self.fill(in_flight, self.depth())
                if not result.interrupted:   # a step cut short says nothing of how long steps take
                    self.build_cost.observe(time.perf_counter() - took_result, result.busy_seconds)
                self.telemetry.on_outputs(outputs)
                self.deliver(outputs)
                self.on_kv_events(*self.scheduler.drain_kv_events())
                await asyncio.sleep(0)   # the streams send this step's tokens before the next result (often done
                #                          already, with async scheduling) is taken without yielding
        finally:
            for _, pending in in_flight:
                pending.cancel()

    def depth(self) -> int:
        """Steps kept with the worker: with async scheduling two (the next one is scheduled and sent while one runs,
        so the worker starts it as soon as it is done), else one. Also one while the policy ranks requests against
        each other (contended: several tenants or priorities), or did lately, and building a step after the last
        one's result costs the worker little: an arrival that outranks the work in hand (a tenant back from a short
        idle, too) then joins the next step, not the one after, and may have the running one cut short
        (interrupt_for)."""
        now = time.monotonic()
        if self.scheduler.policy.contended():
            self.contended_at = now
        late = now - self.contended_at < CONTENDED_MEMORY_S and self.build_cost.small()
        if not self.config.async_scheduling:
            return 1
        return 1 if late else 2

    def fill(self, in_flight: deque, depth: int) -> None:
        while len(in_flight) < depth and (step := self.scheduler.schedule()) is not None:
            in_flight.append(self.send(step))

    def send(self, step: worker_pb2.StepRequest) -> tuple[worker_pb2.StepRequest, asyncio.Future]:
        step.previous_step_id, self.last_sent_step_id = self.last_sent_step_id, step.step_id
        self.last_sent_at = time.perf_counter()
        self.telemetry.on_step(step)
        return step, asyncio.ensure_future(self.worker.step(step, self.config.step_timeout))

    async def wait_on_worker(self, work):
        """await work (a step's result, a restart), marked as time the loop makes no progress (stalled_seconds)."""
        self.waiting_since = time.monotonic()
        try:
            return await work
        finally:
            self.waiting_since = None

    def stalled_seconds(self) -> float:
        """How long the loop has been waiting on its worker; 0 while it is not."""
        return 0.0 if self.waiting_since is None else time.monotonic() - self.waiting_since

    async def restart_worker(self) -> None:
        await self.worker.stop()
        delay = self.triage.restart_delay()
        log.warning("restarting the worker%s", f" in {delay:g}s (it failed again soon)" if delay else "")
        await asyncio.sleep(delay)
        self.info = await self.wait_on_worker(self.worker.start(self.config))
        adapters = self.scheduler.lora.carried_over()
        for name, path in {**adapters.loaded, **adapters.retiring}.items():
            try:
                await self.wait_on_worker(self.worker.load_adapter(name, path))
            except StatusError as e:   # its directory changed since: its requests fail with the reason
                log.error("LoRA adapter %s could not be loaded again: %s", name, e.message)
                adapters.loaded.pop(name, None)
                adapters.retiring.pop(name, None)
        self.last_sent_step_id = 0
        self.forget_cached_blocks()
        old = self.scheduler
        self.scheduler = self.new_scheduler()     # the new worker holds no sequences and an empty pool
        self.scheduler.lora = adapters
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
            if stream is not None and out.error:   # e.g. its grammar did not compile
                self.streams.pop(out.request_id)
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if out.overloaded else grpc.StatusCode.INVALID_ARGUMENT
                stream.put(StatusError(code, out.error))
            elif stream is not None:
                stream.put(out)

    def forget_cached_blocks(self) -> None:
        """The old pool's blocks are gone: withdraw them from the prefix index (after its pending events)."""
        self.on_kv_events(*self.scheduler.drain_kv_events())
        self.on_kv_events([], list(self.scheduler.block_manager.cached))

    def fail_streams(self, reason: str) -> None:
        for request_id, stream in list(self.streams.items()):
            stream.put(WorkerFailed(reason))
            self.telemetry.on_abort(request_id)
            self.scheduler.abort_request(request_id)
        self.streams.clear()

    async def load_adapter(self, name: str, path: str) -> worker_pb2.LoadAdapterResponse:
        """StatusError: FAILED_PRECONDITION with LoRA off, INVALID_ARGUMENT for a bad name or an adapter the worker
        refuses (the reason), ALREADY_EXISTS for a name in use, UNAVAILABLE while the worker restarts."""
        lora = self.scheduler.lora
        if not self.config.enable_lora:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, "LoRA adapters are off: start with --enable-lora")
        if not name or not path:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are required")
        if name in (self.info.model.model_name, *self.config.served_model_name) or name in lora.loaded or (
                name in lora.retiring):
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"the name {name!r} is taken" + (
                " (an adapter being unloaded: its requests are still running)" if name in lora.retiring else ""))
        if self.restarting or self.failure:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the worker is restarting")
        response = await self.worker.load_adapter(name, path)
        self.scheduler.lora.loaded[name] = path
        log.info("LoRA adapter %s loaded from %s (rank %d)", name, path, response.rank)
        self.wakeup.set()
        return response

    def unload_adapter(self, name: str) -> None:
        """StatusError NOT_FOUND if not loaded; requests already using it finish with it."""
        try:
            self.scheduler.unload_lora_adapter(name)
        except AdapterNotFound as e:
            raise StatusError(grpc.StatusCode.NOT_FOUND, str(e)) from e
        log.info("LoRA adapter %s unloaded", name)
        self.wakeup.set()

    def load(self) -> scheduler_pb2.StatsResponse:
        stats = self.scheduler.stats()
        if self.kv_pulls is not None:
            counters = self.kv_pulls.counters
            stats.kv_pulls, stats.kv_pulled_blocks = counters.pulls, counters.pulled_blocks
            stats.kv_pulled_bytes, stats.kv_pull_seconds = counters.pulled_bytes, counters.pull_seconds
            stats.kv_pull_failures, stats.kv_served_blocks = counters.pull_failures, counters.served_blocks
        stats.num_held_requests = len(self.scheduler.held)
        return stats
