"""Telemetry shared by the router, the scheduler and the worker: OpenTelemetry spans exported by OTLP over gRPC,
and a lock-free latency histogram for Prometheus.

Configured only by the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME,
OTEL_TRACES_SAMPLER, OTEL_BSP_SCHEDULE_DELAY...). With no OTLP endpoint set, tracing is off: `Tracing.enabled`
is False, the tracer is a no-op and callers skip their tracing work entirely.
W3C trace context crosses every hop: the submit's trace_context on the Connect stream (router → scheduler) and
`traceparent` strings in the worker's StepRequest (scheduler → worker, whose step spans link to the requests they
served).
"""
from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

TRACEPARENT = "traceparent"
PROPAGATOR = TraceContextTextMapPropagator()
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


@dataclass(frozen=True)
class Tracing:
    tracer: trace.Tracer
    provider: object | None = None     # the SDK TracerProvider when on

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        """Flush what the batch processor still holds (call once, on the way out)."""
        if self.provider is not None:
            self.provider.shutdown()


TRACING_OFF = Tracing(trace.NoOpTracer())


def tracing_configured() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(os.environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def setup_tracing(default_service_name: str) -> Tracing:
    """A tracer for this process: OTLP/gRPC with a batch span processor, or TRACING_OFF without an endpoint.
    OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) overrides `default_service_name`."""
    if not tracing_configured():
        return TRACING_OFF
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    detected = OTELResourceDetector().detect()
    defaults = Resource.create({SERVICE_NAME: default_service_name})
    provider = TracerProvider(resource=defaults.merge(detected))   # sampler: OTEL_TRACES_SAMPLER(_ARG)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(provider.get_tracer("ferry"), provider)


def inject_metadata(span: Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `span` as the parent of whatever the callee does."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The caller's trace context from gRPC metadata (or HTTP headers as pairs); None when there is none."""
    carrier = {key.lower(): value for key, value in metadata or () if isinstance(value, str)}
    if TRACEPARENT not in carrier:
        return None
    return PROPAGATOR.extract(carrier)


def traceparent(span: Span) -> str:
    """The W3C `traceparent` of a span, e.g. to name it inside a protobuf message."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


@lru_cache(maxsize=4096)
def link_to(traceparent_value: str) -> Link | None:
    """A span link to the span a `traceparent` names; None when it names no valid span. Cached and parsed by
    hand: every worker step links every request it serves, the same requests step after step."""
    try:
        version, trace_id, span_id, flags = traceparent_value.split("-")
        span_context = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                                   trace_flags=TraceFlags(int(flags, 16)))
    except ValueError:
        return None
    if version == "ff" or len(trace_id) != 32 or len(span_id) != 16 or not span_context.is_valid:
        return None
    return Link(span_context)


def links_to(traceparents: Iterable[str]) -> list[Link]:
    return [link for link in map(link_to, traceparents) if link is not None]


class TraceContextMiddleware:
    """ASGI: an incoming HTTP `traceparent` becomes the current trace context while the request is handled,
    so the spans its handler starts are children of the caller's."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive, send) -> None:
        parent = None
        if scope["type"] == "http":
            parent = extract_metadata((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
        if parent is None:
            await self.app(scope, receive, send)
            return
        token = otel_context.attach(parent)
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


@dataclass(eq=False)
class LatencyHistogram:
    """A Prometheus histogram cheap enough for every token: observe() is a bisect and two additions, no lock
    (prometheus_client's takes two). Register it in a CollectorRegistry; observe and scrape on one thread
    (router and scheduler both answer /metrics on the event loop that observes)."""
    name: str
    documentation: str
    labels: dict[str, str] = field(default_factory=dict)
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.buckets, seconds)] += 1
        self.total += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        cumulative, running = [], 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts):
            running += count
            cumulative.append((floatToGoString(bound), running))
        family.add_metric(list(self.labels.values()), cumulative, self.total)
        yield family


@dataclass
class TenantLabels:
    """A tenant's metric label, with bounded cardinality: the first `limit` tenants seen have their own (named ones,
    given up front, always), every later one shares `other`."""
    limit: int = 20
    named: frozenset[str] = frozenset()
    seen: set[str] = field(default_factory=set)

    def label(self, tenant: str) -> str:
        if tenant in self.named or tenant in self.seen:
            return tenant
        if len(self.seen) + len(self.named) < self.limit:
            self.seen.add(tenant)
            return tenant
        return "other"
