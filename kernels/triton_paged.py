"""The Triton attention backend over the paged KV pool (layout and signatures: kernels/__init__.py).

Every attention program owns one (sequence, KV head) pair and computes all query heads of that GQA group at
once, so each K/V tile read through the block table is used GROUP times: decode in kernels/triton_decode.py,
prefill in kernels/triton_prefill.py, the pieces they share in kernels/triton_tiles.py. Softmax statistics and
accumulators are fp32; fp32 inputs (and the interpreter, whose bf16 arithmetic is wrong) are upcast right after
every load.

The module imports without Triton or a GPU; the kernels then raise on use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.staging import to_device
from kernels.triton_decode import paged_attention_decode
from kernels.triton_launch import check_pool, next_pow2, require_triton
from kernels.triton_prefill import paged_prefill_attention
from kernels.triton_tiles import HAS_TRITON, tl, triton

# Its metadata is views of the step's tensors, read by the kernels at launch, and no launch waits for the device:
# a CUDA graph captured over persistent buffers replays it (gpu_worker/cuda/cuda_graphs.py).
CAPTURABLE = True

__all__ = ["CAPTURABLE", "HAS_TRITON", "PagedMetadata", "attend", "paged_attention_decode", "paged_prefill_attention",
           "prepare", "store_kv"]


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot
    mask = (slots >= 0) & (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    slot = tl.maximum(slot, 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    key = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    require_triton()
    check_pool(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.dtype != k_cache.dtype or key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.to(k_cache.dtype).contiguous(), value.to(v_cache.dtype).contiguous()  # torch rounds right
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim), num_warps=1 if head_dim <= 64 else 2)


@dataclass
class PagedMetadata:
    """One step's attention inputs for a group of sequences, built once and shared by every layer."""
    block_tables: torch.Tensor    # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor    # [num_seqs] int32, new tokens included
    cu_seqlens_q: torch.Tensor    # [num_seqs + 1] int32
    max_query_len: int
    max_context_len: int
    window: int = 0               # sliding window (0: none)


def prepare(block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
            block_size: int, window: int = 0) -> PagedMetadata:
    """The model runner's per-step hook (same as kernels.torch_paged.prepare). query_lens may be on the host (the
    runner's): its longest entry is then read without waiting for the device."""
    cu_seqlens_q = torch.zeros(query_lens.shape[0] + 1, dtype=torch.int32, device=query_lens.device)
    cu_seqlens_q[1:] = torch.cumsum(query_lens, 0)
    return PagedMetadata(block_tables.to(torch.int32), context_lens.to(torch.int32),
                         to_device(cu_seqlens_q, block_tables.device), int(query_lens.max()),
                         block_tables.shape[1] * block_size, window)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
           scale: float) -> torch.Tensor:
    """query [num_tokens, H, D] packed per sequence → [num_tokens, H, D]."""
    if meta.max_query_len == 1:
        return paged_attention_decode(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      max_context_len=meta.max_context_len, window=meta.window)
    return paged_prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.context_lens, scale, max_query_len=meta.max_query_len, window=meta.window)
