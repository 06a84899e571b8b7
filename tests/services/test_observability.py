"""Observability through real processes: redis-server, a scheduler with its worker and a router export their spans
by OTLP/gRPC to an in-process receiver and serve Prometheus /metrics."""
from __future__ import annotations

import sys
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from ferry.launcher import free_port, wait_for_health
from ferry.stack import Stack
from protos import router_pb2, router_pb2_grpc
from router.policy import POLICIES
from tests.services_fixtures import CHILD_ENV, KV_CACHE_BYTES, collect, greedy, wait_until

MAX_NUM_BATCHED_TOKENS = 16       # a prompt longer than this is prefilled in several chunks
LONG_PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. " * 2


@dataclass
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def attributes(self) -> dict:
        return {a.key: attribute_value(a.value) for a in self.span.attributes}

    @property
    def event_names(self) -> list[str]:
        return [e.name for e in self.span.events]


def attribute_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [attribute_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@dataclass
class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span it is sent."""
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            with self.lock:
                self.spans += [ReceivedSpan(service, span) for scope in resource_spans.scope_spans
                               for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.span.name == name]


@dataclass
class TracedStack:
    receiver: OtlpReceiver
    router_address: str
    redis_url: str
    http_url: str
    scheduler_metrics_url: str


@pytest.fixture(scope="module")
def traced_stack(tiny_llama_dir):
    receiver = OtlpReceiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    env = {**CHILD_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "always_on"}
    env.pop("OTEL_SERVICE_NAME", None)
    stack = Stack()
    try:
        redis_port, scheduler_port, metrics_port, router_port, http_port = (free_port() for _ in range(5))
        stack.start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no"], "redis-server", stdout=sys.stderr)
        redis_url = f"redis://127.0.0.1:{redis_port}"
        stack.start([sys.executable, "-m", "scheduler", "--port", str(scheduler_port), "--scheduler-id", "sched-0",
                     "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
                     "--kv-cache-memory", str(KV_CACHE_BYTES), "--redis-url", redis_url, "--heartbeat-ttl", "2",
                     "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--metrics-port", str(metrics_port)],
                    "scheduler", env=env)
        wait_for_health(f"127.0.0.1:{scheduler_port}", stack, timeout=180)
        stack.start([sys.executable, "-m", "router", "--port", str(router_port), "--redis-url", redis_url,
                     "--http-port", str(http_port)], "router", env=env)
        wait_for_health(f"127.0.0.1:{router_port}", stack, timeout=60)
        yield TracedStack(receiver, f"127.0.0.1:{router_port}", redis_url, f"http://127.0.0.1:{http_port}",
                          f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stack.stop()
        otlp.stop(grace=None)


def generate(stack: TracedStack, prompt: str, max_tokens: int, metadata=(), request_id: str = "") -> list[int]:
    with grpc.insecure_channel(stack.router_address) as channel:
        request = router_pb2.GenerateRequest(request_id=request_id, text=prompt,
                                             sampling=greedy(max_tokens, ignore_eos=True))
        token_ids, _, _ = collect(router_pb2_grpc.RouterStub(channel).Generate(request, metadata=metadata,
                                                                               timeout=60))
    return token_ids


def trace_of(receiver: OtlpReceiver, router_span: ReceivedSpan) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The scheduler span under a router span, and the worker step spans linked to that scheduler span."""
    trace_id = router_span.span.trace_id
    scheduler = [s for s in receiver.named("scheduler.request") if s.span.trace_id == trace_id]
    assert len(scheduler) == 1
    scheduler_id = scheduler[0].span.span_id
    steps = [s for s in receiver.named("worker.step")
             if any(link.trace_id == trace_id and link.span_id == scheduler_id for link in s.span.links)]
    return scheduler[0], steps


def router_span_for(receiver: OtlpReceiver, request_id: str) -> ReceivedSpan | None:
    return next((s for s in receiver.named("router.generate") if s.attributes.get("ferry.request_id") == request_id),
                None)


def test_one_trace_per_request_router_root_scheduler_child_worker_steps_linked(traced_stack):
    token_ids = generate(traced_stack, LONG_PROMPT, 6, request_id="traced-1")
    receiver = traced_stack.receiver

    def complete() -> bool:   # every step's span: the worker's exporter sends them in batches, not all at once
        router = router_span_for(receiver, "traced-1")
        scheduler = router and [s for s in receiver.named("scheduler.request")
                                if s.span.trace_id == router.span.trace_id]
        if not scheduler:
            return False
        expected_steps = scheduler[0].attributes.get("ferry.num_prefill_chunks", 0) + 6 - 1
        return len(trace_of(receiver, router)[1]) >= expected_steps

    wait_until(complete, "the request's spans exported", timeout=20)
    router = router_span_for(receiver, "traced-1")
    scheduler, steps = trace_of(receiver, router)

    assert router.service == "ferry-router" and scheduler.service == "ferry-scheduler"
    assert router.span.parent_span_id == b""                               # the root of the trace
    assert router.span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    route = router.attributes
    assert route["ferry.route.policy"] in POLICIES
    assert route["ferry.route.candidates"] == ["sched-0"]
    assert route["ferry.route.winner"] == "sched-0"
    assert len(route["ferry.route.prefix_blocks_matched"]) == 1
    assert route["ferry.num_generated_tokens"] == len(token_ids) == 6
    assert route["ferry.finish_reason"] == "length"

    assert scheduler.span.parent_span_id == router.span.span_id            # child of the router's span
    request = scheduler.attributes
    assert request["ferry.request_id"] == route["ferry.request_id"]
    assert request["ferry.num_prompt_tokens"] == route["ferry.num_prompt_tokens"] > MAX_NUM_BATCHED_TOKENS
    assert request["ferry.finish_reason"] == "length"
    assert request["ferry.num_generated_tokens"] == 6
    assert request["ferry.num_preemptions"] == 0
    assert request["ferry.num_prefill_chunks"] >= 2                        # chunked by the token budget
    assert 0 <= request["ferry.queue_time_s"] <= request["ferry.time_to_first_token_s"]
    assert scheduler.event_names[0] == "scheduled"
    assert scheduler.event_names.count("prefill_chunk") == request["ferry.num_prefill_chunks"]
    assert "first_token" in scheduler.event_names

    # one worker step per prefill chunk and per later token, each a span of its own linked to the request
    assert len(steps) == request["ferry.num_prefill_chunks"] + 6 - 1
    assert all(s.service == "ferry-worker" and s.span.trace_id != router.span.trace_id for s in steps)
    assert sum(s.attributes["ferry.num_sampled"] for s in steps) == 6


def test_router_span_records_the_prefix_blocks_each_candidate_holds(traced_stack):
    import redis

    prompt = "A prompt whose blocks the scheduler will hold: " + LONG_PROMPT
    store = redis.Redis.from_url(traced_stack.redis_url)

    def num_published_blocks() -> int:
        return sum(store.scard(key) for key in store.scan_iter(match="*:blocks:*"))

    published_before = num_published_blocks()
    generate(traced_stack, prompt, 2, request_id="cold")
    wait_until(lambda: router_span_for(traced_stack.receiver, "cold") is not None, "the cold request's span")
    cold = router_span_for(traced_stack.receiver, "cold").attributes
    wait_until(lambda: num_published_blocks() >= published_before + cold["ferry.route.num_prompt_blocks"],
               "the cold prompt's blocks published to Redis")
    generate(traced_stack, prompt, 2, request_id="warm")
    wait_until(lambda: router_span_for(traced_stack.receiver, "warm") is not None, "the warm request's span")
    warm = router_span_for(traced_stack.receiver, "warm").attributes
    assert warm["ferry.route.num_prompt_blocks"] == cold["ferry.route.num_prompt_blocks"] >= 2
    assert warm["ferry.route.prefix_blocks_matched"] == [warm["ferry.route.num_prompt_blocks"]]
    assert warm["ferry.route.candidates"] == ["sched-0"]


def test_incoming_traceparent_parents_the_router_span_over_grpc_and_http(traced_stack):
    receiver = traced_stack.receiver
    grpc_parent = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    generate(traced_stack, "Paris is the capital of", 3,
             metadata=(("traceparent", f"00-{grpc_parent[0]}-{grpc_parent[1]}-01"),))
    http_parent = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    response = httpx.post(f"{traced_stack.http_url}/v1/completions", timeout=60,
                          headers={"traceparent": f"00-{http_parent[0]}-{http_parent[1]}-01"},
                          json={"prompt": "Berlin is the capital of", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200

    for trace_id, parent_id in (grpc_parent, http_parent):
        def exported() -> bool:
            spans = [s for s in receiver.named("router.generate") if s.span.trace_id.hex() == trace_id]
            scheduler_exported = any(s.span.trace_id.hex() == trace_id for s in receiver.named("scheduler.request"))
            # each service exports on its own schedule: wait for the scheduler's span before reading the trace
            return len(spans) == 1 and scheduler_exported and len(trace_of(receiver, spans[0])[1]) >= 3

        wait_until(exported, f"spans of trace {trace_id}", timeout=20)
        router = next(s for s in receiver.named("router.generate") if s.span.trace_id.hex() == trace_id)
        assert router.span.parent_span_id.hex() == parent_id
        assert trace_of(receiver, router)[0].span.parent_span_id == router.span.span_id


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum over the samples of `name` whose labels include `labels`."""
    return sum(v for (n, sample_labels), v in samples.items()
               if n == name and set(labels.items()) <= set(sample_labels))


def test_metrics_gauges_move_while_requests_run_and_return_to_idle(traced_stack):
    router_metrics = f"{traced_stack.http_url}/metrics"
    before_router, before_scheduler = scrape(router_metrics), scrape(traced_stack.scheduler_metrics_url)
    num_requests, max_tokens = 4, 160
    streaming = threading.Barrier(num_requests + 1)

    def stream(i: int) -> int:
        with grpc.insecure_channel(traced_stack.router_address) as channel:
            request = router_pb2.GenerateRequest(text=f"{i} {LONG_PROMPT}",
                                                 sampling=greedy(max_tokens, ignore_eos=True))
            num_tokens = 0
            for message in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120):
                if num_tokens == 0:
                    streaming.wait()
                num_tokens += len(message.token_ids)
            return num_tokens

    with futures.ThreadPoolExecutor(num_requests) as pool:
        results = [pool.submit(stream, i) for i in range(num_requests)]
        streaming.wait(timeout=60)           # every request has its first token and hundreds still to come
        router_busy, scheduler_busy = scrape(router_metrics), scrape(traced_stack.scheduler_metrics_url)
        outputs = [r.result() for r in results]
    assert outputs == [max_tokens] * num_requests
    assert value(router_busy, "ferry:num_requests_running") >= 1
    assert (value(scheduler_busy, "ferry:num_requests_running")
            + value(scheduler_busy, "ferry:num_requests_waiting")) >= 1
    assert 0 < value(scheduler_busy, "ferry:kv_cache_usage_perc") <= 1

    scheduler, router = scrape(traced_stack.scheduler_metrics_url), scrape(router_metrics)
    assert value(scheduler, "ferry:num_requests_running") == 0
    assert value(scheduler, "ferry:num_requests_waiting") == 0
    assert value(scheduler, "ferry:kv_cache_usage_perc") == 0             # cached prefix blocks count as free
    assert value(router, "ferry:num_requests_running") == 0

    def grew(samples: dict, before: dict, name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    assert grew(scheduler, before_scheduler, "ferry:request_success_total", finished_reason="length") == num_requests
    assert grew(scheduler, before_scheduler, "ferry:generation_tokens_total") == num_requests * max_tokens
    assert grew(scheduler, before_scheduler, "ferry:prompt_tokens_total") > num_requests * MAX_NUM_BATCHED_TOKENS
    assert grew(scheduler, before_scheduler, "ferry:prefix_cache_queries_total") > 0
    assert grew(scheduler, before_scheduler, "ferry:time_to_first_token_seconds_count") == num_requests
    assert grew(scheduler, before_scheduler, "ferry:e2e_request_latency_seconds_count") == num_requests
    assert grew(scheduler, before_scheduler, "ferry:inter_token_latency_seconds_count") > 0
    assert grew(router, before_router, "ferry:router_requests_routed_total", scheduler_id="sched-0") == num_requests
    assert grew(router, before_router, "ferry:request_success_total", finished_reason="length") == num_requests
    assert grew(router, before_router, "ferry:generation_tokens_total") == num_requests * max_tokens
    assert grew(router, before_router, "ferry:time_to_first_token_seconds_count") == num_requests


def test_scheduler_metrics_name_the_workers_device_dtype_cpu_and_kernel_path(traced_stack):
    from gpu_worker.cpu import cpu_features
    from kernels import cpu_decode

    cpu = cpu_features.detect()
    module = cpu_decode.extension()
    expected = {"device": "cpu", "dtype": "float32", "cpu_model": cpu.model, "cpu_capability": cpu.capability,
                "cpu_flags": cpu.as_labels()["cpu_flags"], "cpu_kernels": module.vector_isa() if module else "off"}
    assert value(scrape(traced_stack.scheduler_metrics_url), "ferry:device_info", **expected) == 1
