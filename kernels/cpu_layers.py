"""A decoder layer's elementwise work fused in C++ for the CPU (kernels/csrc/layer_ops_cpu.cpp): the same
interface as gpu_worker.model.TorchLayerOps, the torch version it replaces, with the same roundings."""
from __future__ import annotations

from functools import cache

import torch

from kernels import cpu_build


@cache
def extension(portable: bool = False):
    """The compiled module, or None (FERRY_CPU_KERNELS=0 turns it off). portable=True builds the scalar loops only,
    whatever vector extensions the machine has (tests cover both paths on any machine)."""
    flags = ["-ffp-contract=off", "-fopenmp"]
    if portable:
        return cpu_build.build("ferry_layer_ops_cpu_portable", "layer_ops_cpu.cpp", [*flags, "-DFERRY_PORTABLE"])
    return cpu_build.build("ferry_layer_ops_cpu", "layer_ops_cpu.cpp", flags)


class CpuLayerOps:
    def __init__(self, module):
        self.module = module

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.module.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place; returns RMSNorm(residual)."""
        return self.module.add_rms_norm(x, residual, weight, eps)

    def rotary_store_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """qkv [T, (H + 2 KV) * D] → rotated q [T, H, D]; rotated k and v stored at slots (-1: skipped)."""
        return self.module.rotary_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.module.silu_mul(gate_up)


def layer_ops(portable: bool = False) -> CpuLayerOps | None:
    module = extension(portable)
    return None if module is None else CpuLayerOps(module)
