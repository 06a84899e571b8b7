"""Paged decode attention in C++ for the CPU, compiled on first use (torch's extension builder, cached).

Reads K and V in place from the block pool: no per-layer gather of the whole context. When no compiler is
available the torch path is used instead.
"""
from __future__ import annotations

import os
from functools import cache

import torch

from kernels import cpu_build


@cache
def extension():
    """The compiled module, or None (FERRY_CPU_KERNELS=0 turns it off)."""
    return cpu_build.build("ferry_paged_decode_cpu", "paged_decode_cpu.cpp", ["-ffast-math", "-fopenmp"])


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, portable: bool = False) -> torch.Tensor | None:
    """query [S, H, D] → [S, H, D] in the query's dtype. block_tables int32 and context_lens int32/int64 are used
    as they are (no conversion); portable=True forces the scalar path (tests, on machines with AVX-512)."""
    module = extension()
    if module is None:
        return None
    advise_huge_pages(k_cache)
    advise_huge_pages(v_cache)
    return module.paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale, portable)


_advised: set[tuple[int, int]] = set()


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Once per storage: ask the OS to back the KV pool with 2 MiB pages (FERRY_CPU_HUGEPAGES=0 turns it off).

    The decode reads blocks scattered over the pool; with 4 KiB pages most block reads miss the TLB. A no-op
    where the OS does not support it (the contents are untouched either way)."""
    storage = tensor.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    if key in _advised:
        return
    _advised.add(key)
    module = extension()
    if module is not None and os.environ.get("FERRY_CPU_HUGEPAGES", "1") != "0" and key[1] >= 4 << 20:
        module.advise_huge_pages(*key)
