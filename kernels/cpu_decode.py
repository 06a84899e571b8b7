"""Paged decode attention in C++ for the CPU, compiled on first use (torch's extension builder, cached).

Reads K and V in place from the block pool: no per-layer gather of the whole context. When no compiler is
available the torch path is used instead.
"""
from __future__ import annotations

from functools import cache

import torch

from base import environment
from kernels import cpu_build


@cache
def extension():
    """The compiled module, or None (FERRY_CPU_KERNELS=0 turns it off)."""
    return cpu_build.build("ferry_paged_decode_cpu", "paged_decode_cpu.cpp", ["-ffast-math", "-fopenmp"])


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, portable: bool = False, window: int = 0
                 ) -> torch.Tensor | None:
    """query [S, H, D] → [S, H, D] in the query's dtype. block_tables int32 and context_lens int32/int64 are used
    as they are (no conversion); portable=True forces the scalar path (tests, on machines with AVX-512). window > 0:
    each query sees only the last `window` tokens of its context; blocks wholly before them are not read."""
    module = extension()
    if module is None:
        return None
    return module.paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale, portable, window)


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the OS to back tensor's memory with 2 MiB pages; call it before the memory is first touched (pages
    already there stay small). FERRY_CPU_HUGEPAGES=0 turns it off. The decode reads KV blocks scattered over the
    pool; with 4 KiB pages most block reads miss the TLB, and page walks are dear in a VM. Returns whether the
    advice was taken; the contents are untouched either way."""
    module = extension()
    storage = tensor.untyped_storage()
    if module is None or not environment.FERRY_CPU_HUGEPAGES or storage.nbytes() < 4 << 20:
        return False
    return module.advise_huge_pages(storage.data_ptr(), storage.nbytes()) > 0
