"""`ferry bench offline | roofline | serve | memory | prefix | split | cluster | router | moe`."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from benchmarks import workloads


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure Ferry").add_subparsers(dest="bench", required=True)

    offline = bench.add_parser("offline", help="offline throughput: Ferry's modes and transformers generate")
    add_workload_args(offline)
    offline.add_argument("--modes", default="continuous,hf",
                         help="comma list of continuous, static, contiguous, no-prefix-cache, hf")
    offline.add_argument("--max-num-seqs", type=int, default=128)
    offline.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    offline.add_argument("--hf-batch-size", type=int, default=16)
    offline.set_defaults(handler=run_offline)

    memory = bench.add_parser("memory", help="paged vs contiguous KV occupancy; n=4 prompt sharing")
    add_workload_args(memory)
    memory.add_argument("--kv-cache-memory", type=int, default=16 * 2048 * 23040,
                        help="bytes; the default holds 16 contiguous max_model_len sequences of SmolLM2 in bf16")
    memory.add_argument("--max-model-len", type=int, default=2048)
    memory.add_argument("--max-steps", type=int, default=120)
    memory.add_argument("--plot-dir", type=Path)
    memory.set_defaults(handler=run_memory)

    serve = bench.add_parser("serve", help="online load against a running router")
    add_workload_args(serve)
    serve.add_argument("--target", default="127.0.0.1:50051", help="router gRPC address, or HTTP base URL")
    serve.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    serve.add_argument("--request-rate", default="inf", help="req/s, comma list for a sweep; inf = all at once")
    serve.add_argument("--num-prompts", type=int, default=64)
    serve.add_argument("--max-concurrency", type=int, default=256)
    serve.add_argument("--plot-dir", type=Path)
    serve.set_defaults(handler=run_serve)

    roofline = bench.add_parser("roofline", help="a decode step against the machine's FLOP limit")
    roofline.add_argument("--model", default="", help="local HF model directory (default: SmolLM2-135M-Instruct)")
    roofline.add_argument("--dtype", default="auto", help="auto: what the worker picks on this machine")
    roofline.add_argument("--batch", type=int, default=32)
    roofline.add_argument("--prompt-len", type=int, default=128)
    roofline.add_argument("--steps", type=int, default=32, help="decode steps timed (the median is reported)")
    roofline.add_argument("--matmul-size", type=int, default=4096, help="the square fp32 matmul that sets the peak")
    roofline.add_argument("--json", action="store_true", help="print one JSON object")
    roofline.set_defaults(handler=run_roofline)

    add_prefix_parser(bench)
    add_split_parser(bench)
    add_cluster_parser(bench)
    add_router_parser(bench)
    add_moe_parser(bench)


def add_router_parser(bench) -> None:
    router = bench.add_parser("router", help="issue 21: tokens/s one router relays and its CPU per token, against a "
                                             "synthetic scheduler (no model computed)")
    router.add_argument("--model", default="", help="tokenizer directory (default: SmolLM2-135M-Instruct's)")
    router.add_argument("--clients", default="64", help="concurrent streams, comma list for a sweep")
    router.add_argument("--apis", default="grpc,sse,http", help="comma list of grpc, sse (OpenAI streamed), http "
                                                                "(OpenAI, not streamed)")
    router.add_argument("--duration", type=float, default=5.0, help="seconds of load per run")
    router.add_argument("--max-tokens", type=int, default=128, help="per request")
    router.add_argument("--step-interval", type=float, default=0.01, help="seconds per synthetic engine step")
    router.add_argument("--batch", type=int, default=256, help="most requests the synthetic scheduler runs at once")
    router.add_argument("--workers", type=int, default=1, help="router processes (python -m router --workers)")
    router.add_argument("--stream-interval", type=int, default=0, help="tokens per message clients ask for")
    router.add_argument("--plot-dir", type=Path)
    router.add_argument("--json", action="store_true", help="print one JSON object")
    router.set_defaults(handler=run_router)


def add_prefix_parser(bench) -> None:
    prefix = bench.add_parser("prefix", help="issue 4: prefix caching on/off and hit rate across routing policies, "
                                             "each configuration a fresh `ferry up`")
    add_workload_args(prefix)
    prefix.set_defaults(workload="shared_prefix")
    prefix.add_argument("--request-rate", default="1,inf",
                        help="req/s, comma list; inf = all at once (see benchmarks/prefix_routing.py for why two)")
    prefix.add_argument("--num-prompts", type=int, default=64)
    prefix.add_argument("--max-concurrency", type=int, default=256)
    prefix.add_argument("--configs", default="single,single_no_prefix_cache,cache_aware_x2,round_robin_x2",
                        help="comma list of the stacks to start: single, single_no_prefix_cache and "
                             "<policy>_x2 for cache_aware, round_robin, least_loaded, random, approximate")
    prefix.add_argument("--kv-cache-memory", type=int, default=0, help="bytes per scheduler (0: the default)")
    prefix.add_argument("--device", default="", help="passed to ferry up (default: its own)")
    prefix.set_defaults(handler=run_prefix)


def add_cluster_parser(bench) -> None:
    cluster = bench.add_parser("cluster", help="issue 18: routing policies on a simulated cluster of N real "
                                               "schedulers (discrete-event clock, step cost model, no workers)")
    add_workload_args(cluster)
    cluster.set_defaults(workload="tenants", num_requests=2000)
    cluster.add_argument("--num-schedulers", default="16", help="comma list, e.g. 16,64")
    cluster.add_argument("--policies", default="round_robin,random,least_loaded,approximate,cache_aware")
    cluster.add_argument("--rates-per-scheduler", default="0.5,1,2",
                         help="Poisson req/s per scheduler, comma list (the cluster's rate is N times that)")
    cluster.add_argument("--profile", default="cpu", choices=("cpu", "h100_llama8b"),
                         help="step cost model (benchmarks/cost_model.py)")
    cluster.add_argument("--kv-blocks", type=int, default=0, help="KV pool per scheduler in blocks of 16 "
                                                                   "(0: the profile's)")
    cluster.add_argument("--seed", type=int, default=0, help="arrival times (and the random policy)")
    cluster.add_argument("--plot-dir", type=Path)
    cluster.set_defaults(handler=run_cluster)


def add_split_parser(bench) -> None:
    split = bench.add_parser("split", help="engine offline vs through `ferry up` (1 scheduler), tracing off and on")
    add_workload_args(split)
    split.add_argument("--max-num-seqs", type=int, default=128)
    split.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    split.set_defaults(handler=run_split)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed",
                        choices=("mixed", "shared_prefix", "mixed_small", "chat", *workloads.ROUTING_WORKLOADS))
    parser.add_argument("--workload-file", type=Path, help="JSON list of {prompt_token_ids, max_tokens}")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--model", default="", help="local HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="auto: what the worker picks on this machine")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def load_requests(args, tokenizer_dir: str | None = None) -> list[workloads.BenchRequest]:
    if args.workload_file:
        requests = workloads.load_workload_file(args.workload_file)
        return requests[:args.num_requests] if args.num_requests else requests
    tokenizer = None
    if args.workload == "chat":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return workloads.load(args.workload, tokenizer, args.num_requests)


def model_dir(args) -> str:
    from gpu_worker.model_files import resolve_model_dir
    return str(resolve_model_dir(args.model))


def report(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


def run_offline(args) -> int:
    from benchmarks.offline import ferry_config, run_ferry, run_transformers

    directory = model_dir(args)
    requests = load_requests(args, directory)
    progress = sys.stderr.isatty()
    dtype = concrete_dtype(args.dtype)   # transformers runs in the dtype the engine computes in
    results = {}
    for mode in args.modes.split(","):
        if mode == "hf":
            results[mode] = run_transformers(directory, dtype, requests, args.hf_batch_size, progress).as_dict()
        else:
            config = ferry_config(directory, dtype, mode, args.max_num_seqs, args.kv_cache_memory)
            results[mode] = run_ferry(config, mode, requests, progress).as_dict()
        print(f"[bench] {mode}: {results[mode]['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)
    ratios = {f"{m}/hf": round(r["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"], 3)
              for m, r in results.items() if m != "hf" and "hf" in results}
    if "continuous" in results and "static" in results:
        ratios["continuous/static"] = round(results["continuous"]["output_tokens_per_s"]
                                            / results["static"]["output_tokens_per_s"], 3)
    report(args, {"workload": str(args.workload_file or args.workload), "num_requests": len(requests),
                  "dtype": dtype, "machine": machine(), "results": results, "ratios": ratios})
    return 0


def concrete_dtype(name: str) -> str:
    from gpu_worker.worker import resolve_device, resolve_dtype
    return str(resolve_dtype(name, resolve_device("auto"))).removeprefix("torch.")


def machine() -> str:
    """The device the figures come from (benchmarks are compared on one machine only)."""
    import torch

    from gpu_worker import cpu_features
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return cpu_features.detect().describe()


def add_moe_parser(bench) -> None:
    moe = bench.add_parser("moe", help="issue 26: a Mixtral-shaped decode step vs a dense one of the same active "
                                       "parameters (tiny random models)")
    moe.add_argument("--hidden-size", type=int, default=256)
    moe.add_argument("--layers", type=int, default=4)
    moe.add_argument("--experts", type=int, default=8)
    moe.add_argument("--top-k", type=int, default=2)
    moe.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    moe.add_argument("--dtype", default="auto", help="auto: what the worker picks on this machine")
    moe.add_argument("--batch", type=int, default=32)
    moe.add_argument("--prompt-len", type=int, default=64)
    moe.add_argument("--repeats", type=int, default=32, help="decode steps timed per model, interleaved")
    moe.add_argument("--json", action="store_true", help="print one JSON object")
    moe.set_defaults(handler=run_moe)


def run_moe(args) -> int:
    from benchmarks.moe import MoeShapes, measure

    shapes = MoeShapes(hidden_size=args.hidden_size, num_layers=args.layers, num_experts=args.experts,
                       top_k=args.top_k, expert_size=args.expert_size)
    result = measure(shapes, args.dtype, args.batch, args.prompt_len, args.repeats)
    report(args, {"machine": machine(), **result.as_dict()})
    return 0


def run_roofline(args) -> int:
    from benchmarks.roofline import measure

    result = measure(model_dir(args), args.dtype, args.batch, args.prompt_len, args.steps, args.matmul_size)
    report(args, {"machine": machine(), **result.as_dict()})
    return 0


def run_memory(args) -> int:
    from benchmarks.memory import paged_vs_contiguous, parallel_sampling_saving

    directory = model_dir(args)
    requests = load_requests(args, directory)
    traces = paged_vs_contiguous(directory, args.dtype, requests, args.kv_cache_memory, args.max_model_len,
                                 args.max_steps)
    summaries = {t.layout: t.summary() for t in traces}
    result = {"kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len, **summaries,
              "running_ratio_paged_vs_contiguous": round(summaries["paged"]["peak_running"]
                                                         / max(1, summaries["contiguous"]["peak_running"]), 3),
              "parallel_sampling": parallel_sampling_saving(directory, args.dtype)}
    if args.plot_dir:
        from benchmarks.plots import kv_occupancy
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        kv_occupancy(traces, args.plot_dir / "kv_occupancy.png")
    report(args, result)
    return 0


def run_serve(args) -> int:
    from benchmarks.serve import run_load

    requests = load_requests(args, model_dir(args) if args.workload == "chat" else None)
    requests = (requests * (args.num_prompts // len(requests) + 1))[:args.num_prompts]
    rates = [float(r) for r in args.request_rate.split(",")]
    runs = []
    for rate in rates:
        result = asyncio.run(run_load(requests, args.target, rate, args.max_concurrency, args.backend))
        print(f"[bench] rate {rate}: {result['output_tokens_per_s']:.1f} output tok/s, "
              f"{result['failed']} failed", file=sys.stderr)
        runs.append((rate, result))
    if args.plot_dir:
        from benchmarks.plots import throughput_vs_rate, ttft_distribution
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        throughput_vs_rate(runs, args.plot_dir / "throughput_vs_rate.png")
        for rate, result in runs:
            ttft_distribution(result["ttft_samples_s"], args.plot_dir / f"ttft_rate_{rate:g}.png")
    report(args, {"backend": args.backend, "runs": [{"request_rate": str(r), **res} for r, res in runs]})
    return 0


def run_prefix(args) -> int:
    from benchmarks.prefix_routing import run

    requests = load_requests(args, model_dir(args) if args.workload == "chat" else None)
    report(args, run(args, requests))
    return 0


def run_cluster(args) -> int:
    from benchmarks.cluster_bench import RunSpec, claims, sweep, table

    requests = load_requests(args)
    specs = [RunSpec(int(n), policy, float(rate), args.profile, args.kv_blocks, args.seed)
             for n in args.num_schedulers.split(",") for rate in args.rates_per_scheduler.split(",")
             for policy in args.policies.split(",")]
    runs = sweep(specs, requests)
    print(table(runs), file=sys.stderr, flush=True)
    if args.plot_dir:
        from benchmarks.plots import cluster_sweep
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        sizes = args.num_schedulers.replace(",", "-")
        cluster_sweep(runs, args.plot_dir / f"cluster_{args.workload}_{args.profile}_n{sizes}.png")
    report(args, {"workload": str(args.workload_file or args.workload), "num_requests": len(requests),
                  "profile": args.profile, "runs": runs, "claims": claims(runs)})
    return 0


def run_split(args) -> int:
    from benchmarks.service_overhead import run

    directory = model_dir(args)
    report(args, run(args, load_requests(args, directory), directory))
    return 0


def run_router(args) -> int:
    from benchmarks.router_capacity import BenchOptions, run

    tokenizer_dir = args.model or model_dir(args)   # only its tokenizer is read: no config.json needed
    options = BenchOptions(tokenizer_dir, [int(c) for c in args.clients.split(",")], args.apis.split(","),
                           args.duration, args.max_tokens, args.step_interval, args.batch, args.workers,
                           args.stream_interval)
    result = run(options)
    for r in result["runs"]:
        print(f"[bench] {r['api']} x{r['clients']}: {r['tokens_per_s']:.0f} tok/s, "
              f"{r['router_cpu_us_per_token']} us router CPU/token, added p50 {r['added_latency_ms_p50']} ms "
              f"p99 {r['added_latency_ms_p99']} ms", file=sys.stderr)
    if args.plot_dir:
        from benchmarks.router_capacity import plot_tokens_per_s
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        plot_tokens_per_s(result["runs"], args.plot_dir / f"router_capacity_w{args.workers}.png")
    report(args, result)
    return 0
