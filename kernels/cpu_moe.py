"""A mixture-of-experts layer's expert linears in one C++ call for the CPU (kernels/csrc/moe_cpu.cpp): rows grouped
by expert times their expert's weight, every expert and output panel spread over the threads. One oneDNN call per
expert costs more than the multiply at decode batch sizes (a batch of 32 gives each of 8 experts ~8 rows)."""
from __future__ import annotations

from functools import cache

import torch

from kernels import cpu_build

PANEL = 16   # output columns per packed panel (kPanel in moe_cpu.cpp)


@cache
def extension(portable: bool = False):
    """The compiled module, or None. Its group_by_expert(experts [T, k] int64, weights [T, k] fp32, num_experts)
    gives (source, scale, destination, counts), and grouped_linear(x, counts, packed, source=, scale=,
    destination=) → [rows, N] (moe_cpu.cpp documents both). portable=True builds the scalar loops only."""
    flags = ["-fopenmp", *(["-DFERRY_PORTABLE"] if portable else [])]
    return cpu_build.build("ferry_moe_cpu_portable" if portable else "ferry_moe_cpu", "moe_cpu.cpp", flags)


def supports(weights: torch.Tensor) -> bool:
    """Stacked expert weights [experts, N, K] this kernel can take: fp32 on the CPU, N a whole number of panels."""
    return (weights.device.type == "cpu" and weights.dtype == torch.float32 and weights.dim() == 3
            and weights.shape[1] % PANEL == 0)


def pack(weights: torch.Tensor) -> torch.Tensor:
    """[experts, N, K] → [experts, N / 16, K, 16]: each panel's 16 output columns side by side for every k."""
    experts, n, k = weights.shape
    return weights.detach().view(experts, n // PANEL, PANEL, k).transpose(2, 3).contiguous()

