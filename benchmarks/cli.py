"""`ferry bench NAME [flags]`, the same as `python -m benchmarks NAME [flags]`: every benchmark is a module of its
room with a `main(argv) -> int`, and this table names them. Only the module of the benchmark that runs is imported.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    module: str
    help: str


BENCHMARKS = {
    # kernels: one operation alone, on made-up tensors or rows
    "kernel": Bench("benchmarks.kernels.kernel_bench", "the paged Triton decode kernel's bandwidth against the "
                                                       "device's peak and dense SDPA (CUDA)"),
    "cpu-kernel": Bench("benchmarks.kernels.cpu_decode_bench", "the C++ CPU paged decode kernel against a baseline "
                                                               "revision of it and the torch paths"),
    "cpu-prefill": Bench("benchmarks.kernels.cpu_prefill_bench", "the C++ CPU prefill attention kernel against "
                                                                  "the decode kernel a query row at a time and torch"),
    "grammar-engines": Bench("benchmarks.kernels.grammar_engines", "xgrammar against llguidance: schema compile "
                                                                   "time, a batch's token bitmask per step"),
    # engine: the in-process Engine (scheduler and worker in one process)
    "offline": Bench("benchmarks.engine.offline", "offline throughput: Ferry's modes and transformers generate"),
    "roofline": Bench("benchmarks.engine.roofline", "a decode step against the memory bound (GPU) or the FLOP "
                                                    "limit (CPU)"),
    "memory": Bench("benchmarks.engine.memory", "paged vs contiguous KV occupancy; n=4 prompt sharing"),
    "moe": Bench("benchmarks.engine.moe", "a Mixtral-shaped decode step vs a dense one of the same active "
                                          "parameters (tiny random models)"),
    "structured": Bench("benchmarks.engine.structured", "a decode step with every row under its own JSON schema "
                                                        "vs unconstrained; time to first token, cold and cached"),
    "spec-decode": Bench("benchmarks.engine.spec_decode", "n-gram speculative decoding on vs off on copy-heavy "
                                                          "prompts: tok/s, inter-token latency, acceptance, exactness"),
    "gguf-blocks": Bench("benchmarks.engine.gguf_blocks", "CPU decode steps with linears from a GGUF file's "
                                                          "quantized blocks vs fp32 weights"),
    "lora": Bench("benchmarks.engine.lora", "tok/s with 1, 4 and 16 distinct LoRA adapters in the batch against the "
                                            "base model alone (random adapters)"),
    "tp": Bench("benchmarks.engine.tensor_parallel", "tensor parallelism: tok/s at 1 and 2 ranks, each rank's "
                                                     "weights, and the share of a step in collectives"),
    "vllm-offline": Bench("benchmarks.engine.vllm_offline", "vLLM's offline throughput on the same workloads "
                                                            "(under a Python with vLLM: scripts/vllm_cpu_venv.sh)"),
    "worker-start": Bench("benchmarks.engine.worker_start", "the time a CPU worker spends loading the default "
                                                            "model's weights"),
    # services: real processes (`ferry up`, a router against a synthetic scheduler), over gRPC and HTTP
    "kv-pull": Bench("benchmarks.services.kv_pull", "time to first token of a cached prefix pulled from another "
                                                    "scheduler vs recomputed; the pull's bytes/s"),
    "serve": Bench("benchmarks.services.serve", "online load against a running router"),
    "prefix": Bench("benchmarks.services.prefix_routing", "prefix caching on/off and hit rate across routing "
                                                          "policies, each configuration a fresh `ferry up`"),
    "split": Bench("benchmarks.services.service_overhead", "engine offline vs through `ferry up` (1 scheduler), "
                                                           "tracing off and on"),
    "async": Bench("benchmarks.services.async_scheduling", "async scheduling on vs off through `ferry up`, "
                                                           "alternating rounds"),
    "tenants": Bench("benchmarks.services.multi_tenant", "a light tenant's TTFT alone and beside a flooding one, "
                                                         "and priorities, under each scheduling policy"),
    "chaos": Bench("benchmarks.services.chaos", "faults injected into `ferry up` under streaming load: requests "
                                                "lost, hung or answered differently, and the time to recover"),
    "router": Bench("benchmarks.services.router_capacity", "tokens/s one router relays and its CPU per token, "
                                                           "against a synthetic scheduler (no model computed)"),
    "grpc-stream-cost": Bench("benchmarks.services.grpc_stream_cost", "Python gRPC's own CPU per streamed "
                                                                      "message, no Ferry code"),
    "synthetic-scheduler": Bench("benchmarks.services.synthetic_scheduler", "serve a synthetic scheduler (the "
                                                                            "router bench starts it)"),
    # cluster: a simulated cluster of real schedulers on a discrete-event clock
    "cluster": Bench("benchmarks.cluster.cluster_bench", "routing policies on a simulated cluster of N real "
                                                         "schedulers (step cost model, no workers)"),
    "cost-fit": Bench("benchmarks.cluster.cost_fit", "fit the cluster simulation's step cost model to steps of the "
                                                     "real engine on this machine"),
    "hit-rate-bounds": Bench("benchmarks.cluster.hit_rate_bounds", "the best prefix hit rate any policy can reach "
                                                                   "on `tenants` over 2 schedulers"),
    "long-mix": Bench("benchmarks.cluster.long_mix", "write a workload file where long prefills meet long decodes "
                                                     "(for `ferry bench cluster --workload-file`)"),
    "tenants-file": Bench("benchmarks.cluster.tenants_file", "write a `tenants` workload file of a given shape, its "
                                                             "ids folded into a small vocabulary where asked"),
    # gpu: the check a fresh GPU machine runs (scripts/gpu_check.sh), steps from every room
    "gpu-check": Bench("benchmarks.gpu.check", "Ferry on one NVIDIA GPU, every step a process of its own, one JSON "
                                               "summary"),
}


def names_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry bench", description=__doc__)
    names = parser.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, bench in BENCHMARKS.items():
        names.add_parser(name, help=bench.help)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHMARKS:
        names_parser().parse_args(argv[:1])   # the list of benchmarks, or what is wrong with the name
        return 2
    # SIGTERM unwinds like Ctrl-C: the stacks a benchmark started (in sessions of their own) are stopped on the way
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return int(importlib.import_module(BENCHMARKS[argv[0]].module).main(argv[1:]) or 0)
