"""`ferry bench prefix | split | cluster | router`: the benchmarks of a running stack (started with `ferry up`,
a router against a synthetic scheduler) or of a simulated cluster, their flags and how each runs.
"""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.common.cli_args import add_model_args, add_workload_args, load_requests, machine, model_dir, report


def add_prefix_parser(bench) -> None:
    prefix = bench.add_parser("prefix", help="issue 4: prefix caching on/off and hit rate across routing policies, "
                                             "each configuration a fresh `ferry up`")
    add_workload_args(prefix)
    prefix.set_defaults(workload="shared_prefix")
    prefix.add_argument("--request-rate", default="1,inf",
                        help="req/s, comma list; inf = all at once (see benchmarks/services/prefix_routing.py for why two)")
    prefix.add_argument("--num-prompts", type=int, default=64)
    prefix.add_argument("--max-concurrency", type=int, default=256)
    prefix.add_argument("--configs", default="single,single_no_prefix_cache,cache_aware_x2,round_robin_x2",
                        help="comma list of the stacks to start: single, single_no_prefix_cache and "
                             "<policy>_x2 for cache_aware, round_robin, least_loaded, random, approximate")
    prefix.add_argument("--kv-cache-memory", type=int, default=0, help="bytes per scheduler (0: the default)")
    prefix.add_argument("--device", default="", help="passed to ferry up (default: its own)")
    prefix.set_defaults(handler=run_prefix)


def add_split_parser(bench) -> None:
    split = bench.add_parser("split", help="engine offline vs through `ferry up` (1 scheduler), tracing off and on")
    add_workload_args(split)
    split.add_argument("--max-num-seqs", type=int, default=128)
    split.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    split.set_defaults(handler=run_split)


def add_async_parser(bench) -> None:
    parser = bench.add_parser("async", help="async scheduling on vs off, served and offline, alternating rounds")
    add_workload_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.set_defaults(handler=run_async)


def run_async(args) -> int:
    from benchmarks.services.async_scheduling import run

    directory = model_dir(args)
    report(args, run(args, load_requests(args, directory), directory))
    return 0


def add_chaos_parser(bench) -> None:
    parser = bench.add_parser("chaos", help="faults injected into `ferry up` under streaming load: requests lost, "
                                            "hung or answered differently, and the time to recover, per fault")
    add_model_args(parser)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stop-seconds", type=float, default=10.0, help="how long a scheduler stays SIGSTOPped")
    parser.add_argument("--redis-down-seconds", type=float, default=30.0, help="how long Redis stays SIGSTOPped")
    parser.add_argument("--only", default="", help="comma list of scenario names to run (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # float32: each answer is the same whatever batch it shares, so a resumed stream can be checked token for token
    parser.set_defaults(handler=run_chaos, dtype="float32")


def run_chaos(args) -> int:
    from benchmarks.services import chaos, chaos_faults

    faults = chaos_faults.scenarios(args.stop_seconds, args.redis_down_seconds)
    if args.only:
        faults = [f for f in faults if f.name in args.only.split(",")]
    rows = chaos.run(model_dir(args), faults, args.clients, args.max_tokens, up_flags=("--dtype", args.dtype))
    report(args, {"machine": machine(), "clients": args.clients, "max_tokens": args.max_tokens, "scenarios": rows})
    return 0 if all(r["done"] == r["requests"] and not r["wrong"] for r in rows) else 1


def add_cluster_parser(bench) -> None:
    cluster = bench.add_parser("cluster", help="issue 18: routing policies on a simulated cluster of N real "
                                               "schedulers (discrete-event clock, step cost model, no workers)")
    add_workload_args(cluster)
    cluster.set_defaults(workload="tenants", num_requests=2000)
    cluster.add_argument("--num-schedulers", default="16", help="comma list, e.g. 16,64")
    cluster.add_argument("--policies", default="round_robin,random,least_loaded,approximate,cache_aware")
    cluster.add_argument("--rates-per-scheduler", default="0.5,1,2",
                         help="Poisson req/s per scheduler, comma list (the cluster's rate is N times that)")
    cluster.add_argument("--profile", default="cpu",
                         help="step cost model: cpu, h100_llama8b (benchmarks/cluster/cost_model.py) or a cost-fit file")
    cluster.add_argument("--kv-blocks", type=int, default=0, help="KV pool per scheduler in blocks of 16 "
                                                                   "(0: the profile's)")
    cluster.add_argument("--seed", type=int, default=0, help="arrival times (and the random policy)")
    cluster.add_argument("--num-routers", type=int, default=1, help="router replicas, each with its own policy "
                                                                    "state; arrivals go to them in turn")
    cluster.add_argument("--heartbeat-s", type=float, default=1.0, help="how often the schedulers publish their "
                                                                        "load (cache_aware's window follows)")
    cluster.add_argument("--announce-prompts", action="store_true",
                         help="the schedulers publish a prompt's blocks when they admit it, not only once computed")
    cluster.add_argument("--plot-dir", type=Path)
    cluster.set_defaults(handler=run_cluster)

    cost_fit = bench.add_parser("cost-fit", help="issue 18: fit the cluster simulation's step cost model to steps "
                                                 "of the real engine on this machine")
    add_model_args(cost_fit)
    cost_fit.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores; 1: one of two "
                                                                  "schedulers sharing a 2-core machine)")
    cost_fit.add_argument("--name", default="cpu_fitted", help="the profile's name")
    cost_fit.add_argument("--out", type=Path, help="write the profile here, for `ferry bench cluster --profile`")
    cost_fit.add_argument("--json", action="store_true", help="print one JSON object")
    cost_fit.set_defaults(handler=run_cost_fit)


# flag, type, default, help
ROUTER_FLAGS = [
    ("--model", str, "", "tokenizer directory (default: SmolLM2-135M-Instruct's)"),
    ("--clients", str, "64", "concurrent streams, comma list for a sweep"),
    ("--apis", str, "grpc,sse,http", "comma list of grpc, sse (OpenAI streamed), http (OpenAI, not streamed)"),
    ("--duration", float, 5.0, "seconds of load per run"),
    ("--max-tokens", int, 128, "per request"),
    ("--step-interval", float, 0.01, "seconds per synthetic engine step"),
    ("--batch", int, 256, "most requests the synthetic scheduler runs at once"),
    ("--workers", int, 1, "router processes (python -m router --workers)"),
    ("--stream-interval", int, 0, "tokens per message clients ask for"),
]


def add_router_parser(bench) -> None:
    router = bench.add_parser("router", help="issue 21: tokens/s one router relays and its CPU per token, against a "
                                             "synthetic scheduler (no model computed)")
    for flag, kind, default, text in ROUTER_FLAGS:
        router.add_argument(flag, type=kind, default=default, help=text)
    router.add_argument("--plot-dir", type=Path)
    router.add_argument("--json", action="store_true", help="print one JSON object")
    router.set_defaults(handler=run_router)


def run_prefix(args) -> int:
    from benchmarks.services.prefix_routing import run

    requests = load_requests(args, model_dir(args) if args.workload == "chat" else None)
    report(args, run(args, requests))
    return 0


def run_cost_fit(args) -> int:
    import os

    from benchmarks.cluster.cost_fit import run

    args.threads = args.threads or os.cpu_count() or 1
    report(args, {"machine": machine(), **run(args)})
    return 0


def run_cluster(args) -> int:
    from benchmarks.cluster.cluster_bench import RunSpec, claims, sweep, table

    requests = load_requests(args)
    specs = [RunSpec(int(n), policy, float(rate), args.profile, args.kv_blocks, args.seed, args.num_routers,
                     args.heartbeat_s, args.announce_prompts)
             for n in args.num_schedulers.split(",") for rate in args.rates_per_scheduler.split(",")
             for policy in args.policies.split(",")]
    runs = sweep(specs, requests)
    print(table(runs), file=sys.stderr, flush=True)
    if args.plot_dir:
        from benchmarks.common.plots import cluster_sweep
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        sizes = args.num_schedulers.replace(",", "-")
        cluster_sweep(runs, args.plot_dir / f"cluster_{args.workload}_{Path(args.profile).stem}_n{sizes}.png")
    report(args, {"workload": str(args.workload_file or args.workload), "num_requests": len(requests),
                  "profile": args.profile, "runs": runs, "claims": claims(runs)})
    return 0


def run_split(args) -> int:
    from benchmarks.services.service_overhead import run

    directory = model_dir(args)
    report(args, run(args, load_requests(args, directory), directory))
    return 0


def run_router(args) -> int:
    from benchmarks.services.router_capacity import BenchOptions, run

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
        from benchmarks.services.router_capacity import plot_tokens_per_s
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        plot_tokens_per_s(result["runs"], args.plot_dir / f"router_capacity_w{args.workers}.png")
    report(args, result)
    return 0
