"""The scheduler's telemetry: Prometheus metrics (names close to vLLM's), one span per request, and a periodic
one-line log.

Gauges and cumulative counters are read from `Scheduler.stats()` at scrape time, so the loop pays nothing for
them; latencies are stamped as events where they happen (arrival, first token, each token, finish) and turned
into histograms and span attributes at the end. /metrics is served on the scheduler's own asyncio loop, so a
scrape never reads the scheduler's state from another thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from base.telemetry import LATENCY_BUCKETS, TRACING_OFF, LatencyHistogram, TenantLabels, Tracing, traceparent
from protos import scheduler_pb2, worker_pb2
from scheduler.core import RequestOutput
from scheduler.stats_log import StatsFn, StatsLogger, kv_cache_usage

log = logging.getLogger(__name__)
# The Gateway API Inference Extension's endpoint picker reads a model server's load from vLLM's gauge names
# (its defaults for queued requests, running requests and KV-cache usage, a fraction in 0..1): each load gauge
# is served under both prefixes, so a Ferry scheduler can sit behind that gateway as a vLLM server would.
LOAD_GAUGE_PREFIXES = ("ferry", "vllm")


class StatsCollector:
    """Gauges and counters straight from the core scheduler's own counters, read when Prometheus scrapes."""

    def __init__(self, stats: StatsFn, model_name: str):
        self.stats = stats
        self.labels = ["model_name"], [model_name]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        yield from self.load_gauges(s)
        yield self.counter("ferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           s.prefix_cache_queries)
        yield self.counter("ferry:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           s.prefix_cache_hits)
        yield self.counter("ferry:num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions)
        yield self.counter("ferry:num_interrupted_steps", "Steps cut short for a request that outranked their work.",
                           s.num_interrupted_steps)
        yield self.counter("ferry:prompt_tokens", "Prompt tokens computed (prefill).", s.prompt_tokens_total)
        yield self.counter("ferry:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield from self.spec_decode_counters(s)
        yield from self.kv_transfer_counters(s)
        if s.max_loras:
            yield from self.lora_info(s)

    def spec_decode_counters(self, s: scheduler_pb2.StatsResponse) -> Iterator[CounterMetricFamily]:
        yield self.counter("ferry:spec_decode_num_drafts", "Speculative proposals verified.", s.spec_decode_num_drafts)
        yield self.counter("ferry:spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding.",
                           s.spec_decode_num_draft_tokens)
        yield self.counter("ferry:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                           s.spec_decode_num_accepted_tokens)
        family = CounterMetricFamily("ferry:spec_decode_num_accepted_tokens_per_pos",
                                     "Proposals whose token at this position was accepted.",
                                     labels=[*self.labels[0], "position"])
        for position, accepted in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            family.add_metric([*self.labels[1], str(position)], accepted)
        yield family

    def kv_transfer_counters(self, s: scheduler_pb2.StatsResponse) -> Iterator[CounterMetricFamily]:
        yield self.counter("ferry:kv_pulls", "Prefix KV pulls from peer schedulers started.", s.kv_pulls)
        yield self.counter("ferry:kv_pulled_blocks", "KV blocks pulled from peer schedulers.", s.kv_pulled_blocks)
        yield self.counter("ferry:kv_pulled_bytes", "KV bytes pulled from peer schedulers.", s.kv_pulled_bytes)
        yield self.counter("ferry:kv_pull_seconds", "Time spent in KV pulls.", s.kv_pull_seconds)
        yield self.counter("ferry:kv_pull_failures", "KV pulls that ended early (the rest recomputed).",
                           s.kv_pull_failures)
        yield self.counter("ferry:kv_served_blocks", "KV blocks streamed to peer schedulers.", s.kv_served_blocks)

    def lora_info(self, s: scheduler_pb2.StatsResponse) -> Iterator[GaugeMetricFamily]:
        """vLLM's lora_requests_info (the gateway's LoRA affinity reads it): the adapters running and waiting, as
        comma-separated labels, and max_lora; its value is when it was read."""
        for prefix in LOAD_GAUGE_PREFIXES:
            family = GaugeMetricFamily(f"{prefix}:lora_requests_info", "Running and waiting LoRA adapters.",
                                       labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            family.add_metric([",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters),
                               str(s.max_loras)], time.time())
            yield family

    def load_gauges(self, s: scheduler_pb2.StatsResponse) -> Iterator[GaugeMetricFamily]:
        for prefix in LOAD_GAUGE_PREFIXES:
            yield self.gauge(f"{prefix}:num_requests_running", "Requests scheduled this step (running).",
                             s.num_running)
            yield self.gauge(f"{prefix}:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
            yield self.gauge(f"{prefix}:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.",
                             kv_cache_usage(s))

    def gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=self.labels[0])
        family.add_metric(self.labels[1], value)
        return family

    def counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=self.labels[0])
        family.add_metric(self.labels[1], value)
        return family


class SchedulerMetrics:
    """This scheduler's Prometheus registry: the stats collector plus latency histograms and finish reasons."""

    def __init__(self, stats: StatsFn, model_name: str, device_info: dict[str, str] | None = None,
                 rank_weight_bytes: list[int] = ()):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(stats, model_name))
        Info("ferry:device", "The worker's device, the dtype it computes in and, on a CPU, its model, vector "
             "extensions and the kernels' vector path.", registry=self.registry).info(dict(device_info or {}))
        labels = {"model_name": model_name}
        self.ttft = LatencyHistogram("ferry:time_to_first_token_seconds", "Time to first token.", labels)
        self.inter_token = LatencyHistogram("ferry:inter_token_latency_seconds", "Time between a request's tokens.",
                                            labels)
        self.e2e = LatencyHistogram("ferry:e2e_request_latency_seconds", "Arrival to last token.", labels)
        for histogram in (self.ttft, self.inter_token, self.e2e):
            self.registry.register(histogram)
        self.finished = Counter("ferry:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.worker_idle = Counter("ferry:worker_idle_seconds", "Time the worker waited between the end of a step "
                                   "and the start of the next (what async scheduling takes away while there is work; "
                                   "also the waits when there is none).", ["model_name"],
                                   registry=self.registry).labels(model_name)
        self.tenants = TenantLabels()
        self.tenant_queue_time = Histogram("ferry:tenant_queue_time_seconds", "Arrival at the scheduler to the first "
                                           "step that computes the request, by tenant (the first 20 seen by name, the "
                                           "rest as other).", ["model_name", "tenant"], buckets=LATENCY_BUCKETS,
                                           registry=self.registry)
        self.worker_busy = Counter("ferry:worker_step_seconds", "Time the worker spent in its forward passes and "
                                   "sampling.", ["model_name"], registry=self.registry).labels(model_name)
        self.worker_fed_tokens = Counter("ferry:worker_fed_tokens", "With worker overlap, the input tokens a step "
                                         "read from the previous step's sampled ids on the device, launched before "
                                         "they were on the host.", ["model_name"],
                                         registry=self.registry).labels(model_name)
        self.worker_collectives = Counter("ferry:worker_collective_seconds", "Of the worker's step time, the time "
                                          "rank 0 spent in the tensor-parallel ranks' collectives (all-reduces, "
                                          "logits gathered).", ["model_name"],
                                          registry=self.registry).labels(model_name)
        weights = Gauge("ferry:worker_weight_bytes", "Each worker rank's model parameter bytes (one rank per device "
                        "under tensor parallelism).", ["model_name", "rank"], registry=self.registry)
        for rank, size in enumerate(rank_weight_bytes):
            weights.labels(model_name, str(rank)).set(size)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RequestRecord:
    """Stamps for one request while the scheduler holds it."""
    arrival: float
    num_samples: int
    num_prompt_tokens: int
    span: Span | None = None
    traceparent: str = ""
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0
    num_finished: int = 0
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    seq_ids_sent: set[str] = field(default_factory=set)
    tenant: str = ""                   # its metric label
    queue_time_observed: bool = False


def request_id_of(seq_id: str) -> str:
    return seq_id.rsplit("/", 1)[0]


class SchedulerTelemetry:
    """What the engine loop tells about each request, turned into histograms and (when tracing) spans."""

    def __init__(self, metrics: SchedulerMetrics, tracing: Tracing = TRACING_OFF,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.tracing = tracing
        self.clock = clock
        self.records: dict[str, RequestRecord] = {}

    def on_arrival(self, request_id: str, num_prompt_tokens: int, num_samples: int,
                   parent: Context | None = None, tenant: str = "") -> None:
        record = RequestRecord(self.clock(), num_samples, num_prompt_tokens,
                               tenant=self.metrics.tenants.label(tenant or "default"))
        if self.tracing.enabled:
            record.span = self.tracing.tracer.start_span(
                "scheduler.request", context=parent, kind=SpanKind.SERVER,
                attributes={"ferry.request_id": request_id, "ferry.num_prompt_tokens": num_prompt_tokens,
                            "ferry.n": num_samples})
            if record.span.is_recording():   # a request the sampler dropped costs its steps nothing
                record.traceparent = traceparent(record.span)
        self.records[request_id] = record

    def on_step(self, step: worker_pb2.StepRequest) -> None:
        """Queue times; with tracing, prefill chunks, scheduling and resumption events, and the served requests'
        names in the step."""
        if step.new_seqs:
            self.observe_queue_times(step.new_seqs)
        if not self.tracing.enabled:
            return
        now, served = self.clock(), {}
        for seq in step.new_seqs:
            record = self.records.get(request_id_of(seq.seq_id))
            if record is not None and record.traceparent:
                self.on_new_sequence(record, seq, now)
                served[record.traceparent] = None
        for seq in step.cached_seqs:
            record = self.records.get(request_id_of(seq.seq_id))
            if record is not None and record.traceparent:
                self.on_prefill_chunk(record, seq.num_computed_tokens, seq.num_scheduled_tokens)
                served[record.traceparent] = None
        step.traceparents.extend(served)

    def observe_queue_times(self, new_seqs) -> None:
        now = self.clock()
        for seq in new_seqs:
            record = self.records.get(request_id_of(seq.seq_id))
            if record is not None and not record.queue_time_observed:
                record.queue_time_observed = True
                self.metrics.tenant_queue_time.labels(self.metrics.model_name, record.tenant).observe(
                    now - record.arrival)

    def on_new_sequence(self, record: RequestRecord, seq: worker_pb2.NewSequence, now: float) -> None:
        if record.scheduled_at is None:
            record.scheduled_at = now
            record.span.add_event("scheduled", {"ferry.queue_time_s": now - record.arrival,
                                                "ferry.prefix_cached_tokens": seq.num_computed_tokens})
        elif seq.seq_id in record.seq_ids_sent:
            record.num_preemptions += 1
            record.span.add_event("resumed_after_preemption", {"ferry.seq_id": seq.seq_id,
                                                               "ferry.num_tokens": len(seq.token_ids)})
        record.seq_ids_sent.add(seq.seq_id)
        self.on_prefill_chunk(record, seq.num_computed_tokens, seq.num_scheduled_tokens)

    def on_prefill_chunk(self, record: RequestRecord, num_computed: int, num_scheduled: int) -> None:
        if num_computed < record.num_prompt_tokens and record.first_token_at is None:
            record.num_prefill_chunks += 1
            record.span.add_event("prefill_chunk", {"ferry.num_computed_tokens": num_computed,
                                                    "ferry.num_scheduled_tokens": num_scheduled})

    def on_result(self, result: worker_pb2.StepResult) -> None:
        self.metrics.worker_idle.inc(result.idle_seconds)
        self.metrics.worker_busy.inc(result.forward_seconds)
        self.metrics.worker_collectives.inc(result.collective_seconds)
        self.metrics.worker_fed_tokens.inc(result.num_fed_tokens)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        now, records, inter_token = self.clock(), self.records, self.metrics.inter_token
        for out in outputs:   # every step, every running request: kept lean
            record = records.get(out.request_id)
            if record is None:
                continue
            if out.new_token_ids:
                last = record.last_token_at
                if last is None:
                    self.on_first_token(record, now)
                elif now > last:
                    inter_token.observe(now - last)
                record.last_token_at = now
                record.num_generated += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.on_sample_finished(out.request_id, record, out.finish_reason)

    def on_first_token(self, record: RequestRecord, now: float) -> None:
        record.first_token_at = now
        self.metrics.ttft.observe(now - record.arrival)
        if record.span is not None:
            record.span.add_event("first_token", {"ferry.time_to_first_token_s": now - record.arrival})

    def on_sample_finished(self, request_id: str, record: RequestRecord, finish_reason: str) -> None:
        record.num_finished += 1
        if record.num_finished >= record.num_samples:
            self.finish(request_id, finish_reason)

    def on_abort(self, request_id: str) -> None:
        if request_id in self.records:
            self.finish(request_id, "abort")

    def finish(self, request_id: str, finish_reason: str) -> None:
        record = self.records.pop(request_id)
        now = self.clock()
        self.metrics.e2e.observe(now - record.arrival)
        self.metrics.finished.labels(self.metrics.model_name, finish_reason).inc()
        if record.span is not None:
            self.end_span(record, finish_reason, now)

    def end_span(self, record: RequestRecord, finish_reason: str, now: float) -> None:
        attributes = {"ferry.finish_reason": finish_reason, "ferry.num_generated_tokens": record.num_generated,
                      "ferry.num_preemptions": record.num_preemptions,
                      "ferry.num_prefill_chunks": record.num_prefill_chunks,
                      "ferry.e2e_latency_s": now - record.arrival}
        if record.scheduled_at is not None:
            attributes["ferry.queue_time_s"] = record.scheduled_at - record.arrival
        if record.first_token_at is not None:
            attributes["ferry.time_to_first_token_s"] = record.first_token_at - record.arrival
        record.span.set_attributes(attributes)
        record.span.end()


async def serve_metrics(metrics: SchedulerMetrics, host: str, port: int) -> asyncio.Server:
    """GET /metrics on this event loop (any path answers: it is a one-endpoint server)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            body = metrics.exposition()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE_LATEST.encode() +
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(answer, host, port)


@dataclass
class Reporting:
    """The /metrics endpoint (when a port is given) and the periodic stats line, for as long as a scheduler runs."""
    metrics_server: asyncio.Server | None
    stats_line: asyncio.Task

    @classmethod
    async def start(cls, metrics: SchedulerMetrics, stats: StatsFn, host: str, metrics_port: int,
                    log_interval: float) -> Reporting:
        server = await serve_metrics(metrics, host, metrics_port) if metrics_port else None
        if server is not None:
            log.info("metrics on http://%s:%d/metrics", host, metrics_port)
        logger = StatsLogger(stats, log_interval) if log_interval > 0 else None
        return cls(server, asyncio.create_task(logger.run() if logger else asyncio.sleep(0)))

    async def stop(self) -> None:
        self.stats_line.cancel()
        if self.metrics_server is not None:
            self.metrics_server.close()
            await self.metrics_server.wait_closed()
