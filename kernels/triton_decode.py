"""Paged attention for one new token per sequence (flash-decoding).

A program owns one (sequence, KV head, partition): all query heads of that GQA group at once, over at most
PARTITION_SIZE positions. With several partitions, each writes its fp32 output and log-sum-exp, and a second kernel
merges them.
"""
from __future__ import annotations

import torch

from kernels.triton_launch import LOG2E, NO_WINDOW, check_pool, compute_flags, next_pow2, require_triton
from kernels.triton_tiles import attend_keys, load_tile, tl, triton

DEFAULT_PARTITION_SIZE = 512
DECODE_BLOCK_N = 64


@triton.jit
def _store_partition(part_out_ptr, part_lse_ptr, part_row, out, m_i, l_i, offs_d, head_valid, q_mask,
                     HEAD_DIM: tl.constexpr):
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))  # empty partition: -inf
    tl.store(part_lse_ptr + part_row, lse, mask=head_valid)
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)


@triton.jit
def _decode_kernel(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                   context_lens_ptr, qk_scale, block_size, num_heads, num_partitions, window,
                   stride_qs, stride_qh, stride_os, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, SINGLE_PARTITION: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    part_start = part * PARTITION_SIZE
    part_end = tl.minimum(part_start + PARTITION_SIZE, context_len)
    first_visible = tl.maximum(part_start, context_len - window)   # positions before the window are never read

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    head_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    q_mask = head_valid[:, None] & d_valid[None, :]
    q = load_tile(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], q_mask, UPCAST)
    out, m_i, l_i = attend_keys(q, context_len - 1, first_visible, part_end, window, k_cache_ptr, v_cache_ptr,
                                block_tables_ptr + seq * stride_bt, kv_head, offs_d, d_valid, block_size,
                                stride_cb, stride_cs, stride_ch, qk_scale,
                                GROUP_PAD, BLOCK_D, BLOCK_N, False, UPCAST, DOT_PRECISION)
    if SINGLE_PARTITION:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        _store_partition(part_out_ptr, part_lse_ptr, (seq * num_heads + heads) * num_partitions + part, out,
                         m_i, l_i, offs_d, head_valid, q_mask, HEAD_DIM)


@triton.jit
def _merge_partitions_kernel(out_ptr, part_out_ptr, part_lse_ptr, num_heads, num_partitions, stride_os, stride_oh,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_valid = offs_p < num_partitions
    part_rows = (seq * num_heads + head) * num_partitions + offs_p
    lse = tl.load(part_lse_ptr + part_rows, mask=p_valid, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    mask = p_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    partial = tl.load(part_out_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _partition_buffers(out: torch.Tensor, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each partition's fp32 output and log-sum-exp go; a single partition writes `out` itself."""
    if num_partitions == 1:
        return out, out
    num_seqs, num_heads, head_dim = out.shape
    return (torch.empty(num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32, device=out.device),
            torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=out.device))


def paged_attention_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           partition_size: int = DEFAULT_PARTITION_SIZE,
                           max_context_len: int | None = None, window: int = 0) -> torch.Tensor:
    """Partitions cover max_context_len, or else the block table's width: no device sync either way. window:
    each query sees its last `window` positions (0: all); blocks wholly before them are not read."""
    require_triton()
    check_pool(k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_n = min(DECODE_BLOCK_N, partition_size)
    if partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of {block_n}")
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    num_partitions = max(1, triton.cdiv(max_context_len, partition_size))
    single = num_partitions == 1
    part_out, part_lse = _partition_buffers(out, num_partitions)
    upcast, precision = compute_flags(query.dtype)
    block_d = next_pow2(head_dim, 16)
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, part_out, part_lse, query, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, block_size, num_heads, num_partitions, window or NO_WINDOW,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=next_pow2(group, 16), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PARTITION_SIZE=partition_size, SINGLE_PARTITION=single, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=4 if head_dim <= 128 else 8, num_stages=2 if upcast else 3)
    if not single:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, num_heads, num_partitions, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=next_pow2(num_partitions), num_warps=1)
    return out
