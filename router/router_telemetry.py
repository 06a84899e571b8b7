"""The router's telemetry: Prometheus metrics (names close to vLLM's) and the root span of every request's trace.

The span carries the routing decision (policy, candidates, prefix blocks each candidate holds, winner) and its
context goes upstream in the submit's trace_context on the scheduler's Connect stream. Latencies are measured
where the client sees them: from the request's arrival at the router to each token leaving it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import Response
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from base.telemetry import (LATENCY_BUCKETS, TRACING_OFF, LatencyHistogram, TenantLabels, TraceContextMiddleware,
                            Tracing, inject_metadata)
from protos import router_pb2
from protos.finish_reasons import FINISH_REASON_NAMES
from protos.registration import SchedulerInfo


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("ferry:num_requests_running", "Requests this router is proxying.", registry=r)
        self.routed = Counter("ferry:router_requests_routed", "Requests sent to each scheduler.",
                              ["scheduler_id"], registry=r)
        self.ttft = LatencyHistogram("ferry:time_to_first_token_seconds", "Arrival at the router to first token out.")
        self.inter_token = LatencyHistogram("ferry:inter_token_latency_seconds", "Time between a request's tokens.")
        self.e2e = LatencyHistogram("ferry:e2e_request_latency_seconds", "Arrival to last token.")
        for histogram in (self.ttft, self.inter_token, self.e2e):
            r.register(histogram)
        self.finished = Counter("ferry:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.failed = Counter("ferry:request_failure", "Requests that ended in an error, by gRPC status.",
                              ["code"], registry=r)
        self.prompt_tokens = Counter("ferry:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("ferry:generation_tokens", "Tokens streamed to clients.", registry=r)
        self.retries = Counter("ferry:router_retries", "Requests sent again after this scheduler failed them "
                               "before any token reached the client.", ["scheduler_id"], registry=r)
        self.resumes = Counter("ferry:router_resumes", "Streams continued on another scheduler after this one "
                               "failed them once their tokens had reached the client.", ["scheduler_id"], registry=r)
        self.failovers = Counter("ferry:router_failovers", "Requests this scheduler completed after another one "
                                 "failed them.", ["scheduler_id"], registry=r)
        self.retries_denied = Counter("ferry:router_retries_denied", "Failed requests not sent again, by why: "
                                      "streamed (tokens already out), attempts, budget, no_scheduler.",
                                      ["reason"], registry=r)
        self.breaker_trips = Counter("ferry:router_breaker_trips", "Times this scheduler's circuit breaker opened.",
                                     ["scheduler_id"], registry=r)
        self.tenants = TenantLabels()
        self.tenant_requests = Counter("ferry:tenant_requests", "Requests by tenant (the first 20 seen by name, the "
                                       "rest as other) and outcome: finished, failed.", ["tenant", "outcome"],
                                       registry=r)
        self.tenant_prompt_tokens = Counter("ferry:tenant_prompt_tokens", "Prompt tokens of finished requests, by "
                                            "tenant.", ["tenant"], registry=r)
        self.tenant_generation_tokens = Counter("ferry:tenant_generation_tokens", "Tokens streamed to clients, by "
                                                "tenant.", ["tenant"], registry=r)
        self.tenant_ttft = Histogram("ferry:tenant_time_to_first_token_seconds", "Arrival at the router to first "
                                     "token out, by tenant.", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)

    def watch_breakers(self, states: Callable[[], Mapping[str, int]]) -> None:
        """Publish each scheduler's breaker state as read at scrape time (it moves with the clock)."""
        self.registry.register(BreakerStateCollector(states))

    async def endpoint(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


@dataclass(eq=False)   # hashable: the registry keys collectors by identity
class BreakerStateCollector:
    states: Callable[[], Mapping[str, int]]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("ferry:router_breaker_state", "Circuit breaker per scheduler: 0 closed, "
                                   "1 open (skipped), 2 half-open (on trial).", labels=["scheduler_id"])
        for scheduler_id, state in sorted(self.states().items()):
            family.add_metric([scheduler_id], int(state))
        yield family


@dataclass
class RouterTelemetry:
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    tracing: Tracing = TRACING_OFF
    clock: Callable[[], float] = time.monotonic

    def start(self, trace_parent: Context | None, tenant: str = "") -> RequestObservation:
        span = None
        if self.tracing.enabled:
            span = self.tracing.tracer.start_span("router.generate", context=trace_parent, kind=SpanKind.SERVER,
                                                  attributes={"ferry.tenant": tenant})
        self.metrics.running.inc()
        return RequestObservation(self, self.clock(), span, tenant=self.metrics.tenants.label(tenant))

    def instrument(self, app: FastAPI) -> None:
        """/metrics on the router's HTTP app; an incoming `traceparent` parents the spans of its requests."""
        app.add_api_route("/metrics", self.metrics.endpoint, methods=["GET"], include_in_schema=False)
        if self.tracing.enabled:
            app.add_middleware(TraceContextMiddleware)


@dataclass
class RequestObservation:
    """One request at the router, from arrival to its last token (or error)."""
    telemetry: RouterTelemetry
    arrival: float
    span: Span | None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_prompt_tokens: int = 0
    num_generated: int = 0
    finish_reason: str = ""
    metadata: tuple[tuple[str, str], ...] = ()
    tenant: str = ""                   # its metric label

    def __post_init__(self) -> None:
        if self.span is not None:
            self.metadata = inject_metadata(self.span)

    def routed(self, request_id: str, policy: str, num_prompt_tokens: int, ranked: Sequence[SchedulerInfo],
               matched_blocks: Mapping[str, int], num_prompt_blocks: int, breaker_open: Sequence[str] = ()) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        if self.span is not None:
            self.span.set_attributes({
                "ferry.request_id": request_id, "ferry.num_prompt_tokens": num_prompt_tokens,
                "ferry.route.policy": policy, "ferry.route.num_prompt_blocks": num_prompt_blocks,
                "ferry.route.candidates": [info.scheduler_id for info in ranked],
                "ferry.route.prefix_blocks_matched": [matched_blocks.get(info.scheduler_id, 0) for info in ranked],
                "ferry.route.breaker_open": list(breaker_open)})

    def retried(self, failed: SchedulerInfo, reason: str) -> None:
        self.telemetry.metrics.retries.labels(failed.scheduler_id).inc()
        if self.span is not None:
            self.span.add_event("retry", {"ferry.failed_scheduler": failed.scheduler_id, "ferry.reason": reason})

    def resumed(self, failed: SchedulerInfo, reason: str) -> None:
        self.telemetry.metrics.resumes.labels(failed.scheduler_id).inc()
        if self.span is not None:
            self.span.add_event("resume", {"ferry.failed_scheduler": failed.scheduler_id, "ferry.reason": reason})

    def failed_over(self, target: SchedulerInfo) -> None:
        self.telemetry.metrics.failovers.labels(target.scheduler_id).inc()

    def not_retried(self, reason: str) -> None:
        self.telemetry.metrics.retries_denied.labels(reason).inc()
        if self.span is not None:
            self.span.set_attribute("ferry.retry_denied", reason)

    def breaker_opened(self, scheduler_id: str) -> None:
        self.telemetry.metrics.breaker_trips.labels(scheduler_id).inc()
        if self.span is not None:
            self.span.add_event("breaker_opened", {"ferry.scheduler": scheduler_id})

    def attempt(self, target: SchedulerInfo) -> None:
        self.telemetry.metrics.routed.labels(target.scheduler_id).inc()
        if self.span is not None:
            self.span.set_attributes({"ferry.route.winner": target.scheduler_id,
                                      "ferry.route.winner_address": target.address})

    def on_response(self, response: router_pb2.GenerateResponse) -> None:
        metrics, now, num_tokens = self.telemetry.metrics, self.telemetry.clock(), len(response.token_ids)
        if num_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
                metrics.tenant_ttft.labels(self.tenant).observe(now - self.arrival)
                if self.span is not None:
                    self.span.add_event("first_token")
            elif now > self.last_token_at:
                metrics.inter_token.observe(now - self.last_token_at)
            self.last_token_at = now
            self.num_generated += num_tokens
        if response.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES.get(response.finish_reason, "")

    def fail(self, code: str, message: str) -> None:
        self.telemetry.metrics.failed.labels(code).inc()
        self.telemetry.metrics.tenant_requests.labels(self.tenant, "failed").inc()
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, message))
            self.span.set_attribute("ferry.error_code", code)

    def finish(self) -> None:
        metrics, now = self.telemetry.metrics, self.telemetry.clock()
        metrics.running.dec()
        metrics.generation_tokens.inc(self.num_generated)
        metrics.tenant_generation_tokens.labels(self.tenant).inc(self.num_generated)
        if self.finish_reason:
            metrics.e2e.observe(now - self.arrival)
            metrics.finished.labels(self.finish_reason).inc()
            metrics.prompt_tokens.inc(self.num_prompt_tokens)
            metrics.tenant_requests.labels(self.tenant, "finished").inc()
            metrics.tenant_prompt_tokens.labels(self.tenant).inc(self.num_prompt_tokens)
        if self.span is not None:
            self.span.set_attributes({"ferry.finish_reason": self.finish_reason or "none",
                                      "ferry.num_generated_tokens": self.num_generated})
            self.span.end()
