"""Linears multiplied straight from a GGUF file's Q4_1 / Q8_0 blocks on the CPU (kernels/csrc/quant_linear_cpu.cpp):
the packing of the blocks into the kernel's panels, and the compiled module."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from kernels import cpu_build

PANEL = 16    # output columns per panel (kPanel in panel_gemm.h)
BLOCK = 32    # weights per GGUF block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}   # fp16 scale (+ fp16 min for Q4_1), then the quants


@cache
def extension(portable: bool = False):
    """The compiled module (quantized_linear(x, scales, mins, quants) → x @ W.T), or None. Contraction off: the
    widening must round d * q and + m separately, as gguf's dequantize does."""
    flags = ["-fopenmp", "-ffp-contract=off", *(["-DFERRY_PORTABLE"] if portable else [])]
    return cpu_build.build("ferry_quant_linear_cpu" + ("_portable" if portable else ""), "quant_linear_cpu.cpp", flags)


@dataclass
class QuantizedWeight:
    """A weight [N, K] as the kernel takes it: N / 16 panels of 16 output columns."""
    kind: str                # "Q4_1" or "Q8_0"
    scales: torch.Tensor     # [N / 16, K / 32, 16] fp32
    mins: torch.Tensor       # the same for Q4_1; empty for Q8_0
    quants: torch.Tensor     # [N / 16, K, 8] uint8 (Q4_1: two columns a byte) or [N / 16, K, 16] int8 (Q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.quants.shape[0] * PANEL, self.quants.shape[1]


def packable(out_features: int, in_features: int) -> bool:
    return out_features % PANEL == 0 and in_features % BLOCK == 0


def pack(kind: str, blocks: np.ndarray) -> QuantizedWeight:
    """blocks [N, K / 32, block bytes] uint8: each output row's GGUF blocks, in the file's format."""
    rows, num_blocks, _ = blocks.shape
    scales = to_panels(blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)[..., 0])
    if kind == "Q4_1":
        mins = to_panels(blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)[..., 0])
        packed = blocks[:, :, 4:20]
        quants = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(rows, num_blocks * BLOCK)
        by_column = quants.reshape(rows // PANEL, PANEL, -1).transpose(0, 2, 1)   # [panels, K, 16]
        two_per_byte = by_column[..., :8] | (by_column[..., 8:] << 4)
        return QuantizedWeight(kind, scales, mins, torch.from_numpy(np.ascontiguousarray(two_per_byte)))
    quants = blocks[:, :, 2:34].copy().view(np.int8).reshape(rows, num_blocks * BLOCK)
    by_column = quants.reshape(rows // PANEL, PANEL, -1).transpose(0, 2, 1)
    return QuantizedWeight(kind, scales, torch.empty(0), torch.from_numpy(np.ascontiguousarray(by_column)))


def to_panels(per_row_block: np.ndarray) -> torch.Tensor:
    """[N, K / 32] → [N / 16, K / 32, 16]."""
    rows, num_blocks = per_row_block.shape
    panels = per_row_block.reshape(rows // PANEL, PANEL, num_blocks).transpose(0, 2, 1)
    return torch.from_numpy(np.ascontiguousarray(panels))


def widened(weight: QuantizedWeight) -> torch.Tensor:
    """The fp32 weight [N, K] the blocks hold, computed as gguf's dequantize computes it (the reference)."""
    panels, k, _ = weight.quants.shape
    if weight.kind == "Q4_1":
        low, high = weight.quants & 0x0F, weight.quants >> 4
        quants = torch.cat([low, high], dim=2).float()                              # [panels, K, 16]
    else:
        quants = weight.quants.float()
    values = dequantized(weight.kind, quants, weight.scales, weight.mins)
    return values.transpose(1, 2).reshape(panels * PANEL, k)


def widened_rows(weight: QuantizedWeight, columns: torch.Tensor) -> torch.Tensor:
    """Row p * 16 + columns[p] of each panel p of the weight [panels, K], computed as widened() computes it."""
    panels = torch.arange(weight.quants.shape[0])
    if weight.kind == "Q4_1":
        two_per_byte = weight.quants[panels, :, columns % 8]
        quants = torch.where((columns >= 8)[:, None], two_per_byte >> 4, two_per_byte & 0x0F).float()
        mins = weight.mins[panels, :, columns]
    else:
        quants, mins = weight.quants[panels, :, columns].float(), weight.mins
    return dequantized(weight.kind, quants, weight.scales[panels, :, columns], mins)


def dequantized(kind: str, quants: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """gguf's arithmetic: scale x quant (+ min for Q4_1), a block's scale and min spread over its 32 values along
    dim 1 (K)."""
    values = scales.repeat_interleave(BLOCK, dim=1) * quants
    if kind == "Q4_1":
        values = values + mins.repeat_interleave(BLOCK, dim=1)
    return values
