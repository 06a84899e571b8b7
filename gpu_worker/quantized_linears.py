"""On the CPU in fp32, the linears of a model loaded from a GGUF file keep the file's Q4_1 / Q8_0 blocks for small
batches (kernels/cpu_quant): a decode step reads 4.5-8.5 bits a weight instead of 32. Each linear's rows are found
among the file's tensors by their dequantized values, so fused (qkv, gate_up), permuted (llama.cpp's q and k) and
tied (the LM head) weights need no name tables; a linear whose widened blocks are not bit-identical to the weight it
has keeps the fp32 path. Larger batches (prefill) go to the fp32 linear, where the multiply, not the read, bounds.
FERRY_CPU_GGUF_BLOCKS=0 turns it off."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kernels import cpu_quant

log = logging.getLogger(__name__)
MAX_QUANTIZED_ROWS = 16   # more rows than this: the fp32 linear, faster once a weight serves many rows


class QuantizedLinear(nn.Module):
    def __init__(self, dense: nn.Module, weight: cpu_quant.QuantizedWeight, bias: torch.Tensor | None, kernel):
        super().__init__()
        self.dense = dense
        self.weight_blocks = weight
        self.bias = bias
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_QUANTIZED_ROWS:
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
    kernel = cpu_quant.extension() if os.environ.get("FERRY_CPU_GGUF_BLOCKS", "1") != "0" else None
    if kernel is None:
        return 0
    rows = GgufRows(gguf_file)
    replaced = replace_linears(model, rows, kernel)
    log.info("%d linears multiply from %s's quantized blocks", replaced, gguf_file.name)
    return replaced


def replace_linears(module: nn.Module, rows: GgufRows, kernel) -> int:
    replaced = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            quantized = quantized_linear(child, rows, kernel)
            if quantized is not None:
                setattr(module, name, quantized)
                replaced += 1
        else:
            replaced += replace_linears(child, rows, kernel)
    return replaced


def quantized_linear(linear: nn.Linear, rows: GgufRows, kernel) -> QuantizedLinear | None:
    weight = linear.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if not cpu_quant.packable(linear.out_features, linear.in_features):
        return None
    blocks = rows.weight_of(weight)
    if blocks is None or not torch.equal(cpu_quant.widened(blocks), weight.detach()):
        return None
    bias = None if linear.bias is None else linear.bias.detach()
    return QuantizedLinear(linear, blocks, bias, kernel)
