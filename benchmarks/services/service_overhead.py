"""`ferry bench split`: what the service split and tracing cost, in one run on the same requests.

1. the engine in this process (`Engine.step` in a loop, as `ferry bench offline`);
2. the same requests through `ferry up --num-schedulers 1` (router + scheduler + worker processes, gRPC streams),
   all sent at once by the serve load generator, tracing off;
3. the same again with tracing on: every service exports OTLP to a receiver in this process that counts spans
   (a stand-in for Jaeger, which cannot run here).
Reports output tok/s of each and the ratios (2)/(1), what the split costs, and (3)/(2), what tracing costs
(the targets: >= 90% and >= 97%). `--stream-intervals 1,4` repeats (2) with `ferry up --stream-interval 4`
(tokens per streamed message) after it: what fewer messages buy, as a ratio of the same offline run.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from benchmarks.common.cli_args import add_workload_args, bench_parser, load_requests, model_dir, report
from benchmarks.common.workloads import BenchRequest
from benchmarks.engine.offline import ferry_config, run_ferry
from benchmarks.services.serve import run_load
from benchmarks.services.served_stack import ServedStack


@dataclass
class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that only counts what it receives."""
    spans: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        received = sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


def start_span_counter() -> tuple[SpanCounter, grpc.Server, str]:
    counter = SpanCounter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return counter, server, f"http://127.0.0.1:{port}"


def served(requests: list[BenchRequest], engine_flags: list[str], env: dict[str, str]) -> dict:
    with ServedStack(["--num-schedulers", "1", *engine_flags], env) as stack:
        stack.wait_ready(1)
        result = asyncio.run(run_load(requests, stack.router, float("inf"), len(requests)))
    result.pop("ttft_samples_s", None)
    return result


def run(args, requests: list[BenchRequest], model_dir: str) -> dict:
    config = ferry_config(model_dir, args.dtype, "continuous", args.max_num_seqs, args.kv_cache_memory)
    offline = run_ferry(config, "continuous", requests, progress=sys.stderr.isatty()).as_dict()
    print(f"[bench] offline: {offline['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr, flush=True)
    engine_flags = ["--model", model_dir, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                    "--kv-cache-memory", str(args.kv_cache_memory)]
    first, *others = args.stream_intervals
    at = lambda interval: [*engine_flags, "--stream-interval", str(interval)]  # noqa: E731
    untraced = served(requests, at(first), {"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    print(f"[bench] served, tracing off: {untraced['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr,
          flush=True)
    by_interval = {}
    for interval in others:
        by_interval[interval] = served(requests, at(interval), {"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
        print(f"[bench] served, --stream-interval {interval}: {by_interval[interval]['output_tokens_per_s']:.1f} "
              "output tok/s", file=sys.stderr, flush=True)
    counter, server, endpoint = start_span_counter()
    try:
        traced = served(requests, at(first), {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                                              "OTEL_TRACES_SAMPLER": "always_on"})
    finally:
        server.stop(grace=5)
    print(f"[bench] served, tracing on: {traced['output_tokens_per_s']:.1f} output tok/s, {counter.spans} spans",
          file=sys.stderr, flush=True)
    served_ratio = untraced["output_tokens_per_s"] / offline["output_tokens_per_s"]
    tracing_ratio = traced["output_tokens_per_s"] / untraced["output_tokens_per_s"]
    return {"workload": str(args.workload_file or args.workload), "num_requests": len(requests),
            "dtype": args.dtype, "offline": offline, "served": untraced, "served_traced": traced,
            "spans_received": counter.spans,
            "stream_interval": first, "served_by_stream_interval": by_interval,
            "ratios": {"served/offline": round(served_ratio, 3), "traced/untraced": round(tracing_ratio, 3),
                       **{f"served/offline at --stream-interval {interval}":
                          round(result["output_tokens_per_s"] / offline["output_tokens_per_s"], 3)
                          for interval, result in by_interval.items()}},
            "claims": {"served_within_90pct": served_ratio >= 0.9, "tracing_within_3pct": tracing_ratio >= 0.97}}


def main(argv: list[str]) -> int:
    parser = bench_parser("split", __doc__)
    add_workload_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    parser.add_argument("--stream-intervals", type=positive_ints, default=[1],
                        help="comma list: `ferry up --stream-interval` of the served run (the first) and of further "
                             "untraced served runs")
    args = parser.parse_args(argv)
    directory = model_dir(args)
    report(args, run(args, load_requests(args, directory), directory))
    return 0


def positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma separated: {text!r}")
    return values
