"""`ferry bench worker-start`: the wall time of a CPU worker's `load_model` of the default model in fp32, GGUF
blocks included (read from the GGUF file on a first start, from ~/.cache/ferry/gguf-blocks after it), and how many
linears then multiply from the blocks.

    ferry bench worker-start                                              # as a start finds the cache now
    rm -rf ~/.cache/ferry/gguf-blocks && ferry bench worker-start         # a first start
    FERRY_CPU_GGUF_BLOCKS=0 ferry bench worker-start                      # fp32 weights only
"""
from __future__ import annotations

import time

import torch
from transformers import AutoConfig

from benchmarks.common.cli_args import bench_parser
from gpu_worker.cpu.quantized_linears import QuantizedLinear
from gpu_worker.loading.model_files import gguf_source, resolve_model_dir
from gpu_worker.worker import Worker, model_class


def main(argv: list[str]) -> int:
    bench_parser("worker-start", __doc__).parse_args(argv)
    model_dir = resolve_model_dir("")
    config = AutoConfig.from_pretrained(model_dir)
    family = model_class(config.model_type)
    shape = family.shape_from_config(config)
    start = time.perf_counter()
    model = Worker.load_model(family, shape, config, 2048, model_dir, torch.float32, torch.device("cpu"),
                              gguf_source(""))
    seconds = time.perf_counter() - start
    quantized = sum(isinstance(m, QuantizedLinear) for m in model.modules())
    print(f"load_model {seconds:.2f} s, {quantized} linears from GGUF blocks")
    return 0
