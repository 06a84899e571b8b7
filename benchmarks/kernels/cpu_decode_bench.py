"""`ferry bench cpu-kernel`: CPU paged decode attention alone, the C++ kernel vs a baseline build of it (an older
git revision) vs the torch paths, on shapes like the engine's `mixed` workload: milliseconds a call and effective
GB/s per implementation.

    ferry bench cpu-kernel [--batch 64] [--min-context 64] [--max-context 2048]
        [--baseline-rev e9693e1] [--layers 8] [--rounds 20] [--dtype bfloat16] [--json out.json]

"new+huge" is the new kernel on copies of the pools advised to use 2 MiB pages before their first touch (as
gpu_worker/kv_pool.py allocates the engine's pool). Every layer gets its own KV pool (so consecutive calls do not
find the previous call's K/V in the cache, as in the engine where the 30 layers have 30 pools), with fragmented,
shuffled block tables. Timings of the implementations are interleaved round by round (the machine is shared),
and the ratios are taken per round.
"Effective GB/s" counts the K and V bytes of every context token, read once.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.cli_args import bench_parser
from kernels import cpu_decode, reference, torch_paged

REPO = Path(__file__).resolve().parents[1]
SOURCE_PATH = "kernels/csrc/paged_decode_cpu.cpp"


def build_baseline(rev: str):
    """The kernel source at git revision rev with the headers beside it, built under its own extension name."""
    directory = Path(tempfile.gettempdir()) / "ferry_cpu_decode_bench" / rev
    directory.mkdir(parents=True, exist_ok=True)
    for name in git_output(["ls-tree", "--name-only", rev, "kernels/csrc/"]).split():
        if name.endswith(".h") or name == SOURCE_PATH:
            write_if_changed(directory / Path(name).name, git_output(["show", f"{rev}:{name}"]))
    path = directory / Path(SOURCE_PATH).name
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    from torch.utils.cpp_extension import load
    return load(name=f"ferry_paged_decode_cpu_base_{rev}", sources=[str(path)],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"])


def git_output(args: list[str]) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def make_layer(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               generator: torch.Generator, slack: float = 0.25):
    """A KV pool with room to spare and shuffled block tables: every sequence's blocks are scattered."""
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = int(sum(blocks_per_seq) * (1 + slack)) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    start = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = order[start:start + count]
        start += count
    return k_cache, v_cache, tables


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("cpu-kernel", __doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--min-context", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=8, help="distinct KV pools cycled through")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--baseline-rev", default="e9693e1", help="git revision of the baseline kernel source")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--no-hugepages", action="store_true",
                        help="skip 'new+huge': the new kernel on copies of the pools advised to use 2 MiB pages")
    parser.add_argument("--torch", action="store_true", help="also time the torch paths (reference, gather+SDPA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the calling thread's CPU time (needs --threads 1): robust to other jobs "
                             "taking the cores, not to them taking memory bandwidth")
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time needs --threads 1 (the kernel then runs on the calling thread)")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    context_lens = torch.randint(args.min_context, args.max_context + 1, (args.batch,), generator=generator)
    layers = [make_layer(context_lens.tolist(), args.num_kv_heads, args.head_dim, args.block_size, dtype, generator)
              for _ in range(args.layers)]
    lens32 = context_lens.to(torch.int32)
    queries = [torch.randn(args.batch, args.num_heads, args.head_dim, generator=generator).to(dtype)
               for _ in layers]
    scale = args.head_dim ** -0.5
    kv_bytes = 2 * int(context_lens.sum()) * args.num_kv_heads * args.head_dim * torch.finfo(dtype).bits // 8

    impls = {}
    new = cpu_decode.extension()
    if new is None:
        print("cpu_decode_bench: the C++ kernel could not be built", file=sys.stderr)
        return 1
    impls["new"] = lambda q, k, v, t, c: new.paged_decode(q, k, v, t, c, scale)
    if not args.no_hugepages:
        # copies of the pools, advised before they are first touched (as gpu_worker/kv_pool.py allocates them)
        huge_layers = {}
        for k, v, t in layers:
            k2, v2 = torch.empty_like(k), torch.empty_like(v)
            cpu_decode.advise_huge_pages(k2)
            cpu_decode.advise_huge_pages(v2)
            huge_layers[k.data_ptr()] = (k2.copy_(k), v2.copy_(v))
        impls["new+huge"] = lambda q, k, v, t, c: new.paged_decode(q, *huge_layers[k.data_ptr()], t, c, scale)
    if not args.no_baseline:
        base = build_baseline(args.baseline_rev)
        impls["baseline"] = lambda q, k, v, t, c: base.paged_decode(q, k, v, t, c, scale)
    if args.torch:
        impls["reference"] = lambda q, k, v, t, c: reference.paged_attention_decode(q, k, v, t, c, scale)

        def gather_sdpa(q, k, v, t, c):
            # what torch_paged.prepare builds for decodes when the C++ kernel is absent
            meta = torch_paged.PagedMetadata(len(c), 1, None, None)
            positions = torch.arange(int(c.max()))
            blocks = t.long().gather(1, (positions // args.block_size).clamp(max=t.shape[1] - 1)
                                     .expand(len(c), -1))
            meta.kv_slots = blocks * args.block_size + positions % args.block_size
            meta.mask = (positions.unsqueeze(0) < c.unsqueeze(1)).view(len(c), 1, 1, -1)
            return torch_paged.attend(q, k, v, meta, scale)
        impls["gather+sdpa"] = gather_sdpa

    # correctness first: every implementation against the reference on layer 0
    q, (k, v, t) = queries[0], layers[0]
    expected = reference.paged_attention_decode(q, k, v, t, lens32, scale).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for name, fn in impls.items():
        torch.testing.assert_close(fn(q, k, v, t, lens32).float(), expected, atol=tolerance, rtol=tolerance,
                                   msg=lambda m, name=name: f"{name}: {m}")

    print(f"batch {args.batch}  contexts U[{args.min_context},{args.max_context}] (mean "
          f"{context_lens.float().mean():.0f}, {int(context_lens.sum())} tokens)  heads {args.num_heads}/"
          f"{args.num_kv_heads}  head_dim {args.head_dim}  {args.dtype}  {args.layers} pools  "
          f"KV read {kv_bytes / 1e6:.1f} MB/call  threads {torch.get_num_threads()}"
          f"{'  (thread CPU time)' if args.cpu_time else ''}")
    for fn in impls.values():   # warm up
        for q, (k, v, t) in zip(queries, layers):
            fn(q, k, v, t, lens32)
    times = {name: [] for name in impls}
    slow = {"reference", "gather+sdpa"}
    for round_ in range(args.rounds):
        for name, fn in impls.items():
            if name in slow and round_ % 5:
                continue
            start = clock()
            for q, (k, v, t) in zip(queries, layers):
                fn(q, k, v, t, lens32)
            times[name].append((clock() - start) / len(layers) * 1e3)
    print(f"{'impl':>12} {'median ms':>10} {'p10 ms':>8} {'min ms':>8} {'GB/s@med':>9} {'GB/s@min':>9} "
          f"{'new speedup (median of per-round ratios)':>42}")
    results = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        ratios = [s / n for s, n in zip(samples, times["new"][::5] if name in slow else times["new"])]
        speedup = statistics.median(ratios)
        p10 = statistics.quantiles(samples, n=10)[0] if len(samples) > 1 else samples[0]
        results[name] = {"median_ms": median, "p10_ms": p10, "min_ms": min(samples),
                         "gbps_at_median": kv_bytes / 1e9 / (median / 1e3),
                         "gbps_at_min": kv_bytes / 1e9 / (min(samples) / 1e3), "new_speedup": speedup}
        print(f"{name:>12} {median:>10.3f} {p10:>8.3f} {min(samples):>8.3f} {results[name]['gbps_at_median']:>9.1f} "
              f"{results[name]['gbps_at_min']:>9.1f} {speedup:>41.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kv_mb_per_call": kv_bytes / 1e6, "results": results}, f, indent=2)
    return 0

