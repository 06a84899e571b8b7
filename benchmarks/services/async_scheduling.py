"""`ferry bench async`: output tok/s of the scheduler service with async scheduling on against off, and with the
worker's overlap forced on (each step launched before the previous one's tokens are back, fed on the device), on the
same requests, in alternating rounds: `ferry up --num-schedulers 1`, all requests sent at once; the worker's waits
between steps, its time in steps and the tokens fed on the device read from the scheduler's
`ferry:worker_idle_seconds`, `ferry:worker_step_seconds` and `ferry:worker_fed_tokens`.
"""
from __future__ import annotations

import asyncio
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common.cli_args import add_workload_args, bench_parser, load_requests, model_dir, report
from benchmarks.common.workloads import BenchRequest
from benchmarks.services.serve import run_load
from benchmarks.services.served_stack import ServedStack
from ferry.launcher import free_port

MODES = {"on": ["--worker-overlap", "off"], "off": ["--no-async-scheduling", "--worker-overlap", "off"],
         "overlap": ["--worker-overlap", "on"]}


def counter(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == f"{name}_total")


def worker_counters(metrics_url: str) -> dict:
    return {"idle": counter(metrics_url, "ferry:worker_idle_seconds"),
            "busy": counter(metrics_url, "ferry:worker_step_seconds"),
            "fed": counter(metrics_url, "ferry:worker_fed_tokens")}


def served(requests: list[BenchRequest], engine_flags: list[str]) -> dict:
    """One stack's run. A first request warms it up, and the worker's counters are read around the load only:
    the worker's first step after a quiet spell counts that spell as idle (seconds, on a GPU, from start-up)."""
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with ServedStack(["--num-schedulers", "1", "--metrics-port", str(metrics_port), *engine_flags]) as stack:
        stack.wait_ready(1)
        asyncio.run(run_load([BenchRequest(list(range(1, 9)), 2)], stack.router, float("inf"), 1))
        before = worker_counters(metrics_url)
        result = asyncio.run(run_load(requests, stack.router, float("inf"), len(requests)))
        if result["failed"]:
            raise RuntimeError(f"{result['failed']} of {len(requests)} requests failed: {result['errors']}")
        used = {name: value - before[name] for name, value in worker_counters(metrics_url).items()}
    return {"output_tokens_per_s": round(result["output_tokens_per_s"], 1),
            "duration_s": round(result["duration_s"], 2), "worker_idle_s": round(used["idle"], 3),
            "worker_busy_s": round(used["busy"], 3), "fed_tokens": int(used["fed"])}


def measure(requests: list[BenchRequest], directory: str, dtype: str, max_num_seqs: int = 128,
            kv_cache_memory: int = 0, rounds: int = 2) -> dict:
    """The figures of `ferry bench async` (main's flags; kv_cache_memory 0: the device's default)."""
    engine_flags = ["--model", directory, "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
                    "--kv-cache-memory", str(kv_cache_memory)]
    runs = []
    for i in range(rounds):
        for mode, flags in MODES.items():
            entry = {"round": i, "mode": mode, **served(requests, engine_flags + flags)}
            print(f"[bench] round {i} async {mode}: {entry}", file=sys.stderr, flush=True)
            runs.append(entry)
    total = lambda mode, key: sum(r[key] for r in runs if r["mode"] == mode)  # noqa: E731
    return {"num_requests": len(requests), "rounds": runs,
            "tok_s_on_over_off": round(total("on", "output_tokens_per_s") / total("off", "output_tokens_per_s"), 3),
            "tok_s_overlap_over_on": round(total("overlap", "output_tokens_per_s")
                                           / total("on", "output_tokens_per_s"), 3),
            "worker_idle_share": {mode: round(total(mode, "worker_idle_s") / total(mode, "duration_s"), 4)
                                  for mode in MODES}}


def main(argv: list[str]) -> int:
    parser = bench_parser("async", __doc__)
    add_workload_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    directory = model_dir(args)
    result = measure(load_requests(args, directory), directory, args.dtype, args.max_num_seqs, args.kv_cache_memory,
                     args.rounds)
    report(args, {"workload": args.workload, **result})
    return 0
