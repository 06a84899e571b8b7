"""`ferry bench memory`: KV memory, from the in-process Engine's block manager step by step: how many sequences
run at once in the same KV bytes, paged vs contiguous, and how much of the reserved KV holds real tokens; and the
blocks that n=4 parallel sampling saves by sharing its prompt."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common.cli_args import add_workload_args, bench_parser, load_requests, model_dir, report
from benchmarks.common.workloads import BenchRequest
from ferry import Engine, EngineConfig, SamplingParams


@dataclass
class OccupancyTrace:
    layout: str
    running: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)       # share of the pool's blocks in use
    slot_fill: list[float] = field(default_factory=list)      # share of reserved slots holding real tokens

    def summary(self) -> dict:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {"layout": self.layout, "peak_running": max(self.running, default=0),
                "mean_running": round(mean(self.running), 2), "mean_kv_usage": round(mean(self.kv_usage), 4),
                "mean_slot_fill": round(mean(self.slot_fill), 4), "steps": len(self.running)}


def trace_layout(config: EngineConfig, requests: list[BenchRequest], max_steps: int) -> OccupancyTrace:
    engine = Engine(config)
    for i, r in enumerate(requests):
        engine.add_request(f"m{i}", r.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    trace = OccupancyTrace(config.kv_layout)
    scheduler = engine.scheduler
    while engine.has_unfinished_requests() and len(trace.running) < max_steps:
        engine.step()
        running = scheduler.running
        reserved = sum(len(s.block_ids) for s in running) * scheduler.block_size
        trace.running.append(len(running))
        trace.kv_usage.append(scheduler.block_manager.usage())
        trace.slot_fill.append(sum(s.num_computed_tokens for s in running) / reserved if reserved else 0.0)
    return trace


def paged_vs_contiguous(model: str, dtype: str, requests: list[BenchRequest], kv_cache_memory: int,
                        max_model_len: int = 2048, max_steps: int = 120) -> list[OccupancyTrace]:
    traces = []
    for layout in ("paged", "contiguous"):
        config = EngineConfig(model=model, dtype=dtype, kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
                              max_num_seqs=256, max_num_batched_tokens=4096, kv_layout=layout,
                              enable_prefix_caching=False)
        traces.append(trace_layout(config, requests, max_steps))
    return traces


def parallel_sampling_saving(model: str, dtype: str, prompt_len: int = 512, max_tokens: int = 32, n: int = 4) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompt = [random.Random(0).randrange(3, min(vocab, 40000)) for _ in range(prompt_len)]
    shared = peak_blocks(model, dtype, [(prompt, SamplingParams(temperature=1.0, seed=1, n=n, max_tokens=max_tokens,
                                                                ignore_eos=True))], prefix_caching=True)
    independent = peak_blocks(model, dtype, [(prompt, SamplingParams(temperature=1.0, seed=1 + i, max_tokens=max_tokens,
                                                                     ignore_eos=True)) for i in range(n)],
                              prefix_caching=False)
    return {"prompt_tokens": prompt_len, "max_tokens": max_tokens, "n": n, "blocks_shared": shared,
            "blocks_independent": independent, "ratio": round(shared / independent, 4)}


def peak_blocks(model: str, dtype: str, requests: list, prefix_caching: bool) -> int:
    engine = Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=64, enable_prefix_caching=prefix_caching))
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"p{i}", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        peak = max(peak, stats.num_blocks - stats.num_free_blocks)
    return peak


def main(argv: list[str]) -> int:
    parser = bench_parser("memory", __doc__)
    add_workload_args(parser)
    parser.add_argument("--kv-cache-memory", type=int, default=16 * 2048 * 23040,
                        help="bytes; the default holds 16 contiguous max_model_len sequences of SmolLM2 in bf16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--plot-dir", type=Path)
    args = parser.parse_args(argv)
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
