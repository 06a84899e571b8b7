"""Paged prefill attention in C++ for the CPU, compiled on first use (torch's extension builder, cached).

The causal attention of prefill chunks, a tile of query tokens at a time, reading K and V in place from the block
pool. Built only where a vector path exists (AVX-512 or AVX2 with FMA); elsewhere, or when no compiler is
available, prefill chunks go to the decode kernel one query row at a time (kernels/torch_paged.py).
"""
from __future__ import annotations

from functools import cache

import torch

from base import environment
from kernels import cpu_build


@cache
def extension():
    """The compiled module, or None (no vector path, no compiler, FERRY_CPU_KERNELS=0 or FERRY_CPU_PREFILL_KERNEL=0)."""
    if not environment.FERRY_CPU_PREFILL_KERNEL:
        return None
    module = cpu_build.build("ferry_paged_prefill_cpu", "paged_prefill_cpu.cpp", ["-ffast-math", "-fopenmp"])
    return module if module is not None and module.vector_isa() != "portable" else None


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor, scale: float,
                  window: int, out: torch.Tensor) -> None:
    """Writes into out [T, H, D] (like query) the causal attention of sequence s's query rows [query_starts[s],
    + query_lens[s]), the last of its context_lens[s] tokens (all already in the pool); out's other rows are left
    as they are. window > 0: each query sees its last `window` positions, itself included."""
    extension().paged_prefill(query, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, scale,
                              window, out)
