"""On the CPU in fp32, the linears of a model loaded from a GGUF file keep the file's Q4_1 / Q8_0 blocks for small
batches (kernels/cpu_quant): a decode step reads 4.5-8.5 bits a weight instead of 32. Each linear's rows are found
among the file's tensors by their dequantized values, so fused (qkv, gate_up), permuted (llama.cpp's q and k) and
tied (the LM head) weights need no name tables; a linear whose widened blocks are not bit-identical to the weight it
has keeps the fp32 path. What was found is cached between starts (below). Larger batches (long prefills) go to the
fp32 linear, where the multiply, not the read, bounds. FERRY_CPU_GGUF_BLOCKS=0 turns it off."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from torch import nn

from base import environment
from gpu_worker.loading.model_files import gguf_blocks_dir
from kernels import cpu_quant

log = logging.getLogger(__name__)
# More rows than this, by the vector path the kernel was built for: the fp32 linear (oneDNN), whose blocking of rows
# wins once a weight serves many. AVX2, measured on the AVX2 EPYC (ferry bench gguf-blocks, issue 17): the blocks'
# kernel is 1.01-1.04x oneDNN on the default model's 576x1536 and 1536x576 linears at 256 rows, 0.93-0.99x at 384;
# a 256-row decode step 1.16x. AVX-512 (oneDNN multiplies 16 lanes at a time there, the kernel 8) and the portable
# path keep the limit of the first, in-register kernel, not measured past it.
MAX_QUANTIZED_ROWS = {"avx2": 256, "avx512": 16, "portable": 16}


class QuantizedLinear(nn.Module):
    def __init__(self, dense: nn.Module, weight: cpu_quant.QuantizedWeight, bias: torch.Tensor | None, kernel):
        super().__init__()
        self.dense = dense
        self.weight_blocks = weight
        self.bias = bias
        self.kernel = kernel
        self.max_rows = MAX_QUANTIZED_ROWS[kernel.vector_isa()]
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > self.max_rows:
            return self.dense(x)
        blocks = self.weight_blocks
        out = self.kernel.quantized_linear(rows.contiguous(), blocks.scales, blocks.mins, blocks.quants)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


class GgufRows:
    """Every row of the file's Q4_1 / Q8_0 tensors, by a hash of its dequantized fp32 values (a collision is caught
    by the bit-for-bit check of the whole weight)."""

    def __init__(self, gguf_file: Path):
        from gguf import GGUFReader, dequantize

        self.blocks: dict[int, tuple[str, np.ndarray]] = {}
        for tensor in GGUFReader(gguf_file).tensors:
            kind = tensor.tensor_type.name
            if kind not in cpu_quant.BLOCK_BYTES or len(tensor.data.shape) != 2:
                continue
            raw = tensor.data.reshape(tensor.data.shape[0], -1, cpu_quant.BLOCK_BYTES[kind])
            for values, row in zip(dequantize(tensor.data, tensor.tensor_type), raw):
                self.blocks[hash(values.astype(np.float32).tobytes())] = (kind, row)

    def weight_of(self, weight: torch.Tensor) -> cpu_quant.QuantizedWeight | None:
        """weight [N, K] fp32 as blocks of one kind, or None if some row is not in the file."""
        found = [self.blocks.get(hash(row.tobytes())) for row in weight.detach().numpy()]
        if any(f is None for f in found) or len({kind for kind, _ in found}) != 1:
            return None
        return cpu_quant.pack(found[0][0], np.stack([row for _, row in found]))


def use_gguf_blocks(model: nn.Module, gguf_file: Path) -> int:
    """Replace each fp32 nn.Linear whose rows the file holds in Q4_1 / Q8_0 blocks; returns how many were."""
    kernel = cpu_quant.extension() if environment.FERRY_CPU_GGUF_BLOCKS else None
    if kernel is None:
        return 0
    linears = {name: module for name, module in model.named_modules() if takes_blocks(module)}
    cache = gguf_blocks_dir(gguf_file)
    blocks, origin = cached_blocks(cache, gguf_file, linears), f"cached in {cache}"
    if blocks is None:
        source = file_identity(gguf_file)   # before reading: a file changed meanwhile leaves a stale cache
        blocks, origin = blocks_in_file(gguf_file, linears), "read from the file"
        save_blocks(cache, source, linears, blocks)
    for name, weight in blocks.items():
        linear = linears[name]
        bias = None if linear.bias is None else linear.bias.detach()
        model.set_submodule(name, QuantizedLinear(linear, weight, bias, kernel))
    log.info("%d linears multiply from %s's quantized blocks (%s)", len(blocks), gguf_file.name, origin)
    return len(blocks)


def takes_blocks(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu" and cpu_quant.packable(module.out_features, module.in_features))


def blocks_in_file(gguf_file: Path, linears: dict[str, nn.Linear]) -> dict[str, cpu_quant.QuantizedWeight]:
    """The blocks of each linear whose weight they widen to bit for bit."""
    rows = GgufRows(gguf_file)
    found = {}
    for name, linear in linears.items():
        weight = rows.weight_of(linear.weight)
        if weight is not None and torch.equal(cpu_quant.widened(weight), linear.weight.detach()):
            found[name] = weight
    return found


# The blocks found for a model are cached, so that a start reads 100 MB of packed blocks instead of parsing,
# dequantizing and matching the whole file (seconds). They were checked bit for bit against the weights when
# written; a start checks that the file is the one they came from (path, size, modification time), that the cache
# is intact (sha256), that the model has the same linears, and one row of every panel of 16 against the weights.
# Anything else (stale, foreign, truncated, unreadable) is rebuilt from the file.
CACHE_LAYOUT = 1                 # bumped whenever QuantizedWeight's packing changes
CACHE_TENSORS = "blocks.safetensors"
CACHE_INDEX = "blocks.json"


def file_identity(gguf_file: Path) -> dict:
    stat = gguf_file.stat()
    return {"path": str(gguf_file.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "layout": CACHE_LAYOUT}


def cached_blocks(cache: Path, gguf_file: Path,
                  linears: dict[str, nn.Linear]) -> dict[str, cpu_quant.QuantizedWeight] | None:
    """The cached blocks of the model's linears, or None where the cache is missing or is not theirs."""
    try:
        index = json.loads((cache / CACHE_INDEX).read_text())
        data = (cache / CACHE_TENSORS).read_bytes()
    except (OSError, ValueError):
        return None
    if (not isinstance(index, dict) or index.get("source") != file_identity(gguf_file)
            or index.get("sha256") != hashlib.sha256(data).hexdigest()
            or sorted(index.get("linears", {})) != sorted(linears)):
        return None
    tensors = safetensors.torch.load(data)
    blocks = {name: cached_weight(tensors, name, kind) for name, kind in index["linears"].items() if kind}
    if not all(sampled_rows_match(weight, linears[name].weight) for name, weight in blocks.items()):
        return None
    return blocks


def cached_weight(tensors: dict[str, torch.Tensor], name: str, kind: str) -> cpu_quant.QuantizedWeight:
    mins = tensors[f"{name}.mins"] if kind == "Q4_1" else torch.empty(0)
    return cpu_quant.QuantizedWeight(kind, tensors[f"{name}.scales"], mins, tensors[f"{name}.quants"])


def sampled_rows_match(blocks: cpu_quant.QuantizedWeight, weight: torch.Tensor) -> bool:
    """One row of every panel, a different one from panel to panel, widened and compared bit for bit (1/16 of
    the full check's work): blocks of another conversion, or of another linear, differ in nearly every row."""
    if blocks.shape != tuple(weight.shape):
        return False
    panels = blocks.quants.shape[0]
    columns = torch.arange(panels) % cpu_quant.PANEL
    rows = torch.arange(panels) * cpu_quant.PANEL + columns
    return torch.equal(cpu_quant.widened_rows(blocks, columns), weight.detach()[rows])


def save_blocks(cache: Path, source: dict, linears: dict[str, nn.Linear],
                blocks: dict[str, cpu_quant.QuantizedWeight]) -> None:
    """Written atomically, tensors first: a reader sees a matching pair or a sha256 that does not match. A cache
    that cannot be written is left out; the next start reads the file again."""
    tensors = {}
    for name, weight in blocks.items():
        tensors[f"{name}.scales"], tensors[f"{name}.quants"] = weight.scales, weight.quants
        if weight.kind == "Q4_1":
            tensors[f"{name}.mins"] = weight.mins
    data = safetensors.torch.save(tensors)
    index = {"source": source, "sha256": hashlib.sha256(data).hexdigest(),
             "linears": {name: blocks[name].kind if name in blocks else None for name in linears}}
    try:
        cache.mkdir(parents=True, exist_ok=True)
        write_atomically(cache / CACHE_TENSORS, data)
        write_atomically(cache / CACHE_INDEX, json.dumps(index, indent=1).encode())
    except OSError as error:
        log.warning("the quantized blocks are not cached (%s): the next start reads the GGUF file again", error)


def write_atomically(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name + ".", delete=False) as staging:
        staging.write(data)
    try:
        os.replace(staging.name, path)
    except OSError:
        os.unlink(staging.name)
        raise
