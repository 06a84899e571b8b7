"""`ferry bench gguf-blocks`: decode steps of a model from a GGUF file on the CPU with its linears multiplied from
the file's Q4_1 / Q8_0 blocks against the same model in fp32 weights (FERRY_CPU_GGUF_BLOCKS=0), at several batch
sizes. `ferry bench gguf-blocks [--batches 1,4,16,32] [--max-quantized-rows N]` (the default model): two engines,
their steps timed alternately at each batch, the medians in a markdown table; --max-quantized-rows moves the batch
above which the blocks' engine uses its fp32 linears (gpu_worker.cpu.quantized_linears.MAX_QUANTIZED_ROWS), to
measure where the blocks still win.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from base.config import EngineConfig
from benchmarks.common.cli_args import bench_parser
from benchmarks.engine.roofline import start_decoding
from ferry.engine import Engine
from gpu_worker.cpu import quantized_linears
from gpu_worker.cpu.quantized_linears import QuantizedLinear

BATCHES = (1, 4, 16, 32)
STEPS = 16


def engine_with_blocks(on: bool, batches: tuple[int, ...]) -> Engine:
    os.environ["FERRY_CPU_GGUF_BLOCKS"] = "1" if on else "0"   # read as the worker loads the model
    return Engine(EngineConfig(dtype="float32", device="cpu", max_num_seqs=max(batches)))


def step_ms(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1e3


def finish(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def parsed(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("gguf-blocks", __doc__)
    parser.add_argument("--batches", type=lambda text: tuple(int(b) for b in text.split(",")), default=BATCHES,
                        help="comma-separated batch sizes (default %(default)s)")
    parser.add_argument("--max-quantized-rows", type=int,
                        help="rows above which the blocks' engine multiplies in fp32 (default: the worker's limit for "
                             "the kernel's vector path)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parsed(argv)
    if args.max_quantized_rows is not None:
        quantized_linears.MAX_QUANTIZED_ROWS = dict.fromkeys(quantized_linears.MAX_QUANTIZED_ROWS,
                                                             args.max_quantized_rows)
    fp32, blocks = engine_with_blocks(False, args.batches), engine_with_blocks(True, args.batches)
    quantized = sum(isinstance(m, QuantizedLinear) for m in blocks.worker.runner.model.modules())
    print(f"{quantized} linears from the file's blocks\n\n| batch | fp32 weights ms | GGUF blocks ms | speed-up |")
    print("|---:|---:|---:|---:|")
    for batch in args.batches:
        for engine in (fp32, blocks):
            start_decoding(engine, batch, 32, STEPS, f"b{batch}", lowest_token_id=100)
        times = {id(fp32): [], id(blocks): []}
        for _ in range(STEPS):   # alternately, so that machine noise falls on both
            for engine in (fp32, blocks):
                times[id(engine)].append(step_ms(engine))
        slow, fast = statistics.median(times[id(fp32)]), statistics.median(times[id(blocks)])
        print(f"| {batch} | {slow:.1f} | {fast:.1f} | {slow / fast:.2f}x |")
        finish(fp32)
        finish(blocks)
    return 0
