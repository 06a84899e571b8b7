"""`ferry bench offline | roofline | serve | memory | prefix | split | async | chaos | cluster | router | moe |
structured`."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from benchmarks.common.cli_args import (add_batch_args, add_dtype_arg, add_model_args, add_workload_args, concrete_dtype,
                                 load_requests, machine, model_dir, report)
from benchmarks.cli_stacks import (add_async_parser, add_chaos_parser, add_cluster_parser, add_prefix_parser,
                                   add_router_parser, add_split_parser)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure Ferry").add_subparsers(dest="bench", required=True)

    offline = bench.add_parser("offline", help="offline throughput: Ferry's modes and transformers generate")
    add_workload_args(offline)
    offline.add_argument("--modes", default="continuous,hf",
                         help="comma list of continuous, static, contiguous, no-prefix-cache, eager (no CUDA "
                              "graphs), hf")
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

    roofline = bench.add_parser("roofline", help="a decode step against the memory bound (GPU) or the FLOP limit (CPU)")
    add_model_args(roofline)
    add_batch_args(roofline, prompt_len=128)
    roofline.add_argument("--steps", type=int, default=32, help="decode steps timed (the median is reported)")
    roofline.add_argument("--matmul-size", type=int, default=4096, help="the square fp32 matmul that sets the peak")
    roofline.add_argument("--json", action="store_true", help="print one JSON object")
    roofline.set_defaults(handler=run_roofline)

    add_prefix_parser(bench)
    add_split_parser(bench)
    add_async_parser(bench)
    add_chaos_parser(bench)
    add_cluster_parser(bench)
    add_router_parser(bench)
    add_moe_parser(bench)
    add_structured_parser(bench)


def run_offline(args) -> int:
    from benchmarks.engine.offline import ferry_config, run_ferry, run_transformers

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


def add_moe_parser(bench) -> None:
    moe = bench.add_parser("moe", help="issue 26: a Mixtral-shaped decode step vs a dense one of the same active "
                                       "parameters (tiny random models)")
    moe.add_argument("--hidden-size", type=int, default=256)
    moe.add_argument("--layers", type=int, default=4)
    moe.add_argument("--experts", type=int, default=8)
    moe.add_argument("--top-k", type=int, default=2)
    moe.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    add_dtype_arg(moe)
    add_batch_args(moe, prompt_len=64)
    moe.add_argument("--repeats", type=int, default=32, help="decode steps timed per model, interleaved")
    moe.add_argument("--json", action="store_true", help="print one JSON object")
    moe.set_defaults(handler=run_moe)


def run_moe(args) -> int:
    from benchmarks.engine.moe import MoeShapes, measure

    shapes = MoeShapes(hidden_size=args.hidden_size, num_layers=args.layers, num_experts=args.experts,
                       top_k=args.top_k, expert_size=args.expert_size)
    result = measure(shapes, args.dtype, args.batch, args.prompt_len, args.repeats)
    report(args, {"machine": machine(), **result.as_dict()})
    return 0


def add_structured_parser(bench) -> None:
    structured = bench.add_parser("structured", help="issue 19: a decode step with every row under its own JSON "
                                                     "schema vs unconstrained; time to first token, cold and cached")
    add_model_args(structured)
    add_batch_args(structured, prompt_len=64)
    structured.add_argument("--repeats", type=int, default=32, help="decode steps timed per batch, interleaved")
    structured.add_argument("--trials", type=int, default=5, help="lone requests timed per time-to-first-token case")
    structured.add_argument("--json", action="store_true", help="print one JSON object, not a markdown table")
    structured.set_defaults(handler=run_structured)


def run_structured(args) -> int:
    from benchmarks.engine.structured import measure

    result = measure(model_dir(args), args.dtype, args.batch, args.prompt_len, args.repeats, args.trials)
    if args.json:
        report(args, {"machine": machine(), **result.as_dict()})
    else:
        print(f"{machine()}, {result.dtype}, {result.timed_steps} decode steps timed\n\n{result.markdown()}")
    return 0


def run_roofline(args) -> int:
    """On a GPU the decode step against the memory bound (weights and KV read at the measured bandwidth), on a CPU
    against the FLOP limit."""
    import torch

    from benchmarks.engine.roofline import measure, measure_memory_bound

    if torch.cuda.is_available():
        result = measure_memory_bound(model_dir(args), concrete_dtype(args.dtype), args.batch, args.prompt_len,
                                      args.steps)
    else:
        result = measure(model_dir(args), args.dtype, args.batch, args.prompt_len, args.steps, args.matmul_size)
    report(args, {"machine": machine(), **result.as_dict()})
    return 0


def run_memory(args) -> int:
    from benchmarks.engine.memory import paged_vs_contiguous, parallel_sampling_saving

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
        from benchmarks.common.plots import kv_occupancy
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        kv_occupancy(traces, args.plot_dir / "kv_occupancy.png")
    report(args, result)
    return 0


def run_serve(args) -> int:
    from benchmarks.services.serve import run_load

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
        from benchmarks.common.plots import throughput_vs_rate, ttft_distribution
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        throughput_vs_rate(runs, args.plot_dir / "throughput_vs_rate.png")
        for rate, result in runs:
            ttft_distribution(result["ttft_samples_s"], args.plot_dir / f"ttft_rate_{rate:g}.png")
    report(args, {"backend": args.backend, "runs": [{"request_rate": str(r), **res} for r, res in runs]})
    return 0


