"""`ferry bench cpu-prefill`: CPU paged attention of prefill chunks alone, on one layer's shuffled pool: the C++
prefill kernel against the decode kernel taking each query row as a decode (the path before the prefill kernel,
and the one without a vector path) and the torch path (batched matmuls a sequence). Milliseconds a call, the causal
attention's GFLOP/s (4 x heads x head_dim x the keys each query sees), and the prefill kernel's speed-up over each,
taken per round (the implementations alternate round by round) and reported as the median.

    ferry bench cpu-prefill [--chunks 512,512] [--cached 0] [--num-heads 9] [--num-kv-heads 3] [--head-dim 64]
        [--dtype float32] [--rounds 10] [--json]

The default shape is SmolLM2-135M's layer with two 512-token prompts: a 1,024-token step of guidellm's heavier
shape on a CPU.
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common.cli_args import bench_parser, machine, report
from kernels import cpu_decode, cpu_prefill, torch_paged

BLOCK_SIZE = 16


def shuffled_pool(contexts: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = [-(-context // BLOCK_SIZE) for context in contexts]
    order = torch.randperm(sum(blocks), generator=generator).to(torch.int32)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    start = 0
    for seq, count in enumerate(blocks):
        tables[seq, :count] = order[start:start + count]
        start += count
    shape = (sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype), tables


def implementations(tables: torch.Tensor, contexts: torch.Tensor, query_lens: torch.Tensor) -> dict:
    """Each path's metadata, prepared once as the model runner prepares it once a step."""
    found = {}
    if cpu_prefill.extension() is not None:
        found["prefill kernel"] = torch_paged.prepare(tables, contexts, query_lens, BLOCK_SIZE)
    if cpu_decode.extension() is not None:
        rows_tables, rows_contexts = torch_paged.query_rows_as_decodes(tables, contexts, query_lens)
        found["decode kernel rows"] = torch_paged.PagedMetadata(int(rows_contexts.shape[0]), 1, None, None, None,
                                                                rows_tables, rows_contexts)
    found["torch"] = torch_paged.PagedMetadata(
        len(contexts), int(query_lens.max()), None, None,
        torch_paged.prefill_chunks(tables, contexts.tolist(), query_lens.tolist(), BLOCK_SIZE))
    return found


def causal_gflop(contexts: list[int], chunks: list[int], num_heads: int, head_dim: int) -> float:
    seen = sum(sum(range(context - chunk + 1, context + 1)) for context, chunk in zip(contexts, chunks))
    return 4 * num_heads * head_dim * seen / 1e9


def measure(chunks: list[int], cached: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            rounds: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    contexts = [cached + chunk for chunk in chunks]
    k_cache, v_cache, tables = shuffled_pool(contexts, num_kv_heads, head_dim, dtype, generator)
    query = torch.randn(sum(chunks), num_heads, head_dim, generator=generator).to(dtype)
    paths = implementations(tables, torch.tensor(contexts, dtype=torch.int32), torch.tensor(chunks, dtype=torch.int32))
    scale = head_dim ** -0.5
    outputs = {name: torch_paged.attend(query, k_cache, v_cache, meta, scale) for name, meta in paths.items()}
    seconds = {name: [] for name in paths}
    for _ in range(rounds):
        for name, meta in paths.items():
            start = time.perf_counter()
            torch_paged.attend(query, k_cache, v_cache, meta, scale)
            seconds[name].append(time.perf_counter() - start)
    gflop = causal_gflop(contexts, chunks, num_heads, head_dim)
    result = {"machine": machine(), "dtype": str(dtype).removeprefix("torch."), "chunks": chunks, "cached": cached,
              "heads": [num_heads, num_kv_heads, head_dim], "gflop": round(gflop, 4),
              "ms": {name: round(statistics.median(times) * 1e3, 3) for name, times in seconds.items()},
              "gflop_s": {name: round(gflop / statistics.median(times), 1) for name, times in seconds.items()},
              "max_abs_difference": {name: float((out.float() - outputs["torch"].float()).abs().max())
                                     for name, out in outputs.items() if name != "torch"}}
    if "prefill kernel" in seconds:
        ours = seconds["prefill kernel"]
        result["prefill kernel speed-up"] = {
            name: round(statistics.median(theirs / mine for theirs, mine in zip(times, ours)), 2)
            for name, times in seconds.items() if name != "prefill kernel"}
    return result


def main(argv: list[str]) -> int:
    parser = bench_parser("cpu-prefill", __doc__, json_output=True)
    parser.add_argument("--chunks", default="512,512", help="new tokens of each sequence, comma separated")
    parser.add_argument("--cached", type=int, default=0, help="tokens of each sequence already in the pool")
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    chunks = [int(chunk) for chunk in args.chunks.split(",")]
    result = measure(chunks, args.cached, args.num_heads, args.num_kv_heads, args.head_dim,
                     getattr(torch, args.dtype), args.rounds)
    report(args, result)
    return 0
