"""`ferry bench tp`: the in-process Engine at each tensor-parallel size (--sizes), on a prefill phase (--num-requests
prompts of --prompt-len, one token out) and a decode phase (the same number of short prompts, --max-tokens out,
one batch). For each: output (decode) or prompt (prefill) tokens per second, the seconds per step, and of those
the seconds rank 0 spent in collectives (all-reduces, logits gathered) and handing the step to the other ranks;
each rank's parameter bytes, and the other ranks' resident memory. On a CPU the ranks share the cores
(OMP_NUM_THREADS split between them): this measures what the collectives cost, not a speed-up.

--heads H:KV measures a copy of the model with H query and KV heads and random weights (same sizes otherwise):
SmolLM2-135M's 9 and 3 heads split across 3 ranks, not 2."""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.common.cli_args import (add_model_args, add_rounds_args, bench_parser, concrete_dtype, machine,
                                        model_dir, report)
from ferry import Engine, EngineConfig, SamplingParams

MiB = 1 << 20


def prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab_size - 10, (length,), generator=generator).tolist() for _ in range(num)]


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def phase(engine: Engine, batch: list[list[int]], max_tokens: int) -> dict:
    """One batch to the end: tokens/s (prompt tokens when max_tokens is 1, else output tokens) and per-step costs."""
    worker = engine.worker
    collectives = worker.tp.collective_seconds if worker.tp else 0.0
    forwarded = worker.followers.forward_seconds if worker.followers else 0.0
    steps = engine.stats().num_steps
    started = time.perf_counter()
    results = engine.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - started
    num_steps = engine.stats().num_steps - steps
    tokens = sum(len(p) for p in batch) if max_tokens == 1 else sum(len(r.token_ids) for r in results)
    collective = (worker.tp.collective_seconds - collectives) if worker.tp else 0.0
    forward = (worker.followers.forward_seconds - forwarded) if worker.followers else 0.0
    return {"tokens_per_s": tokens / seconds, "ms_per_step": 1e3 * seconds / num_steps,
            "collective_ms_per_step": 1e3 * collective / num_steps, "forward_ms_per_step": 1e3 * forward / num_steps,
            "collective_share": collective / seconds}


def with_heads(directory: str, heads: str, scratch: str) -> str:
    """A copy of the model's config with H:KV heads (the head size kept where it can be), random bf16 weights."""
    config = AutoConfig.from_pretrained(directory)
    config.num_attention_heads, config.num_key_value_heads = (int(n) for n in heads.split(":"))
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(scratch)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(directory) / name).is_file():
            (Path(scratch) / name).write_bytes((Path(directory) / name).read_bytes())
    return scratch


def measure(directory: str, dtype: str, sizes: list[int], num_requests: int = 16, prompt_len: int = 256,
            max_tokens: int = 32, rounds: int = 3, kv_cache_memory: int = 1 << 28) -> dict:
    vocab_size, threads = AutoConfig.from_pretrained(directory).vocab_size, torch.get_num_threads()
    long, short = prompts(num_requests, prompt_len, vocab_size, 0), prompts(num_requests, 8, vocab_size, 1)
    figures, memory = {}, {}
    for size in sizes:
        engine = Engine(EngineConfig(model=directory, dtype=dtype, tensor_parallel_size=size,
                                     enable_prefix_caching=False, max_num_seqs=num_requests,
                                     kv_cache_memory=kv_cache_memory))
        phase(engine, short[:2], 2)   # warm-up
        runs = {"prefill": [], "decode": []}
        for round_index in range(rounds):
            runs["prefill"].append(phase(engine, long, 1))
            runs["decode"].append(phase(engine, short, max_tokens))
            print(f"[bench] tp={size} round {round_index}: prefill {runs['prefill'][-1]['tokens_per_s']:.0f} tok/s, "
                  f"decode {runs['decode'][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        figures[size] = {name: {key: round(statistics.median(r[key] for r in results), 4) for key in results[0]}
                         for name, results in runs.items()}
        followers = engine.worker.followers.processes if engine.worker.followers else []
        memory[size] = {"rank_weight_bytes": list(engine.started.rank_weight_bytes),
                        "follower_rss_mib": [resident_mib(p.pid) for p in followers]}
        if engine.worker.followers:
            engine.worker.followers.stop()
    base = sizes[0]
    ratios = {size: {name: round(figures[size][name]["tokens_per_s"] / figures[base][name]["tokens_per_s"], 3)
                     for name in ("prefill", "decode")} for size in sizes}
    return {"machine": machine(), "dtype": dtype, "threads": threads, "num_requests": num_requests,
            "prompt_len": prompt_len, "max_tokens": max_tokens, "rounds": rounds, "figures": figures,
            "tokens_per_s_ratio_to_first_size": ratios, "memory": memory}


def main(argv: list[str]) -> int:
    parser = bench_parser("tp", __doc__, json_output=True)
    add_model_args(parser)
    parser.add_argument("--sizes", default="1,2", help="comma list of tensor-parallel sizes")
    add_rounds_args(parser, num_requests=16, prompt_len=256, max_tokens=32, rounds=3)
    parser.add_argument("--heads", default="", help="H:KV: measure a random-weight copy of the model with these heads")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        directory = with_heads(model_dir(args), args.heads, scratch) if args.heads else model_dir(args)
        result = measure(directory, concrete_dtype(args.dtype), [int(s) for s in args.sizes.split(",")],
                         args.num_requests, args.prompt_len, args.max_tokens, args.rounds)
    report(args, result | {"heads": args.heads or "the model's"})
    return 0
