"""`ferry bench kernel`: decode attention on a CUDA GPU, Ferry's paged Triton kernel vs dense SDPA over the same tokens.

    ferry bench kernel [--batch 64] [--contexts 1024 2048 4096] [--head-dims 64 128]

For every (head_dim, context) it reports the paged kernel's time, the bytes it must read (K and V of every
context token, plus queries, outputs and block tables), the achieved GB/s against the device's peak memory
bandwidth, and the time ratio to torch's scaled_dot_product_attention over contiguous K/V of the same tokens.
The C++ CPU decode kernel is measured by `ferry bench cpu-kernel`.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks.common.cli_args import bench_parser

# Published peak memory bandwidth (GB/s), used when the driver does not report clock and bus width.
KNOWN_PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0,
                   "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0, "A10": 600.0,
                   "RTX 4090": 1008.0, "RTX 3090": 936.0, "V100": 900.0, "T4": 320.0}


@dataclass
class DecodeShape:
    """One measured decode step: batch sequences of context_len tokens each, in blocks of block_size."""
    batch: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


@dataclass
class DecodeResult:
    shape: DecodeShape
    paged_us: float
    sdpa_us: float
    gb_moved: float
    achieved_gbps: float
    peak_gbps: float

    @property
    def fraction_of_peak(self) -> float:
        return self.achieved_gbps / self.peak_gbps

    @property
    def ratio_to_sdpa(self) -> float:
        return self.paged_us / self.sdpa_us

    def as_row(self) -> dict:
        """The shape and the measurements in one flat row (the --json file's)."""
        measured = {name: value for name, value in asdict(self).items() if name != "shape"}
        return asdict(self.shape) | measured | {"fraction_of_peak": self.fraction_of_peak,
                                                "ratio_to_sdpa": self.ratio_to_sdpa}


def peak_bandwidth_gbps(device: torch.device) -> float:
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    for name, gbps in KNOWN_PEAK_GBPS.items():
        if name in props.name:
            return gbps
    raise RuntimeError(f"unknown peak bandwidth of {props.name}: pass --peak-gbps")


def time_us(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200) * 1e3


def make_paged_inputs(shape: DecodeShape, device: torch.device):
    """Dense K/V [batch, kv_heads, context, head_dim] and the same tokens scattered over a shuffled pool."""
    batch, context_len, num_kv_heads, head_dim = shape.batch, shape.context_len, shape.num_kv_heads, shape.head_dim
    block_size, dtype = shape.block_size, getattr(torch, shape.dtype)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch * blocks_per_seq
    keys = torch.randn(batch, num_kv_heads, context_len, head_dim, dtype=dtype, device=device)
    values = torch.randn_like(keys)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(context_len, device=device)
    blocks = block_tables.long()[:, positions // block_size]                       # [batch, context]
    k_cache[blocks, positions % block_size] = keys.transpose(1, 2)
    v_cache[blocks, positions % block_size] = values.transpose(1, 2)
    query = torch.randn(batch, shape.num_heads, head_dim, dtype=dtype, device=device)
    context_lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    return query, keys, values, k_cache, v_cache, block_tables, context_lens


def bench_decode(shape: DecodeShape, peak_gbps: float) -> DecodeResult:
    from kernels import triton_paged
    query, keys, values, k_cache, v_cache, block_tables, context_lens = make_paged_inputs(shape, torch.device("cuda"))
    scale = shape.head_dim ** -0.5

    def paged():
        return triton_paged.paged_attention_decode(query, k_cache, v_cache, block_tables, context_lens, scale)

    def dense():
        return F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, scale=scale,
                                              enable_gqa=shape.num_heads != shape.num_kv_heads)

    torch.testing.assert_close(paged().float(), dense().squeeze(2).float(), atol=2e-2, rtol=2e-2)
    element = torch.finfo(query.dtype).bits // 8
    kv_bytes = 2 * keys.numel() * element                                          # K and V
    other_bytes = 2 * query.numel() * element + block_tables.numel() * 4
    gb = (kv_bytes + other_bytes) / 1e9
    paged_us = time_us(paged)
    return DecodeResult(shape, paged_us, time_us(dense), gb, gb / (paged_us * 1e-6), peak_gbps)


def format_row(result: DecodeResult) -> str:
    return (f"{result.shape.head_dim:>8} {result.shape.context_len:>8} {result.paged_us:>10.1f} "
            f"{result.sdpa_us:>10.1f} {result.achieved_gbps:>9.0f} {100 * result.fraction_of_peak:>7.1f}% "
            f"{result.ratio_to_sdpa:>9.2f}x")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("kernel", __doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak bandwidth")
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device here; the Triton decode kernel benchmark needs a GPU (nothing run). "
              "The CPU decode kernel has its own: ferry bench cpu-kernel")
        return 0
    peak = args.peak_gbps or peak_bandwidth_gbps(torch.device("cuda"))
    print(f"device: {torch.cuda.get_device_name()}  peak {peak:.0f} GB/s  batch {args.batch}  "
          f"heads {args.num_heads}/{args.num_kv_heads}  block {args.block_size}  {args.dtype}")
    print(f"{'head_dim':>8} {'context':>8} {'paged us':>10} {'sdpa us':>10} {'GB/s':>9} {'of peak':>8} "
          f"{'vs sdpa':>10}")
    results = []
    for head_dim in args.head_dims:
        for context_len in args.contexts:
            shape = DecodeShape(args.batch, context_len, args.num_heads, args.num_kv_heads, head_dim,
                                args.block_size, args.dtype)
            result = bench_decode(shape, peak)
            results.append(result)
            print(format_row(result), flush=True)
    if args.json:
        rows = [result.as_row() for result in results]
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "results": rows}, f, indent=2)
    return 0

