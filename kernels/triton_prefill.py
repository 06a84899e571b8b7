"""Paged attention for the new tokens of many sequences packed together (prefill and chunked prefill), causal.

A program owns one (sequence, KV head, tile of query tokens): its rows are (query token, head of the group) pairs,
BLOCK_Q tokens x GROUP_PAD heads, so each K/V tile read through the block table serves the whole group.
"""
from __future__ import annotations

import torch

from kernels.triton_launch import LOG2E, NO_WINDOW, check_pool, compute_flags, next_pow2, require_triton
from kernels.triton_tiles import attend_keys, load_tile, tl, triton

PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64


@triton.jit
def _prefill_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                    qk_scale, block_size, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_cs, stride_ch,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    prefix_len = tl.load(context_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tokens = q_tile * BLOCK_Q + rows // GROUP_PAD
    group_index = rows % GROUP_PAD
    heads = kv_head * GROUP + group_index
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_mask = ((tokens < q_len) & (group_index < GROUP))[:, None] & d_valid[None, :]
    token_index = (q_start + tokens).to(tl.int64)
    q = load_tile(q_ptr + token_index[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], q_mask,
                  UPCAST)
    last_token = tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    key_end = tl.where(q_tile * BLOCK_Q < q_len, prefix_len + last_token, 0)  # causal: nothing past the tile
    key_start = tl.maximum(prefix_len + q_tile * BLOCK_Q - window + 1, 0)    # the tile's first query's window
    out, m_i, l_i = attend_keys(q, prefix_len + tokens, key_start, key_end, window, k_cache_ptr, v_cache_ptr,
                                block_tables_ptr + seq * stride_bt, kv_head, offs_d, d_valid, block_size,
                                stride_cb, stride_cs, stride_ch, qk_scale,
                                BLOCK_Q * GROUP_PAD, BLOCK_D, BLOCK_N, True, UPCAST, DOT_PRECISION)
    tl.store(out_ptr + token_index[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_query_len: int | None = None, window: int = 0) -> torch.Tensor:
    """Pass max_query_len when the caller knows it, to save reading cu_seqlens_q back from the device. window: as
    in paged_attention_decode, each query row's own."""
    require_triton()
    check_pool(k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    query = query if query.stride(-1) == 1 else query.contiguous()
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = max(1, PREFILL_BLOCK_M // group_pad)
    block_q = min(block_q, next_pow2(max_query_len, max(1, 16 // group_pad)))  # short chunks: smaller tiles
    upcast, precision = compute_flags(query.dtype)
    _prefill_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        out, query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        scale * LOG2E, block_size, window or NO_WINDOW, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim, 16),
        BLOCK_N=PREFILL_BLOCK_N, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=4 if head_dim <= 64 else 8, num_stages=2 if upcast else 3)  # fp32 tiles: keep shared memory low
    return out
