"""Triton kernels over the paged KV pool (layout and signatures: kernels/__init__.py).

Every attention program owns one (sequence, KV head) pair and computes all query heads of that GQA group at
once, so each K/V tile read through the block table is used GROUP times. Decode splits long contexts into
partitions (one program each) and merges their partial softmaxes in a second kernel (flash-decoding).
Softmax statistics and accumulators are fp32; fp32 inputs (and the interpreter, whose bf16 arithmetic is
wrong) are upcast right after every load.

The module imports without Triton or a GPU; the kernels then raise on use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # CPU-only installs: keep the module importable
    HAS_TRITON = False

    class _NoTriton:
        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _NoTriton()

DEFAULT_PARTITION_SIZE = 512
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30          # the kernels' window argument when every query sees its whole context


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


@triton.jit
def _load_kv_tiles(k_cache_ptr, v_cache_ptr, block_table_row, positions, valid, kv_head, offs_d, d_valid, block_size,
                   stride_cb, stride_cs, stride_ch, UPCAST: tl.constexpr):
    """K and V, [BLOCK_N, BLOCK_D] each, of one KV head at the given token positions (one block-table lookup)."""
    blocks = tl.load(block_table_row + positions // block_size, mask=valid, other=0).to(tl.int64)
    rows = blocks * stride_cb + (positions % block_size) * stride_cs + kv_head * stride_ch
    offsets = rows[:, None] + offs_d[None, :]
    mask = valid[:, None] & d_valid[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One step of online softmax (log2 domain): fold a K/V tile into the running max, sum and output."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


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
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt
    for start in range(first_visible, part_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < part_end
        k, v = _load_kv_tiles(k_cache_ptr, v_cache_ptr, block_table_row, positions, valid, kv_head, offs_d, d_valid,
                              block_size, stride_cb, stride_cs, stride_ch, UPCAST)
        m_i, l_i, acc = _attend_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SINGLE_PARTITION:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part_row = (seq * num_heads + heads) * num_partitions + part
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))  # empty partition: -inf
        tl.store(part_lse_ptr + part_row, lse, mask=head_valid)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)


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


@triton.jit
def _prefill_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                    qk_scale, block_size, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_cs, stride_ch,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Rows of the tile are (query token, head of the group) pairs: BLOCK_Q tokens x GROUP_PAD heads."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tokens = q_tile * BLOCK_Q + rows // GROUP_PAD
    group_index = rows % GROUP_PAD
    heads = kv_head * GROUP + group_index
    row_valid = (tokens < q_len) & (group_index < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_mask = row_valid[:, None] & d_valid[None, :]
    token_index = (q_start + tokens).to(tl.int64)
    q = tl.load(q_ptr + token_index[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    query_positions = prefix_len + tokens

    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt
    last_token = tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    key_end = tl.where(q_tile * BLOCK_Q < q_len, prefix_len + last_token, 0)  # causal: nothing past the tile
    key_start = tl.maximum(prefix_len + q_tile * BLOCK_Q - window + 1, 0)    # the tile's first query's window
    for start in range(key_start, key_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < key_end
        k, v = _load_kv_tiles(k_cache_ptr, v_cache_ptr, block_table_row, positions, valid, kv_head, offs_d, d_valid,
                              block_size, stride_cb, stride_cs, stride_ch, UPCAST)
        visible = valid[None, :] & (positions[None, :] <= query_positions[:, None])
        visible = visible & (positions[None, :] > query_positions[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token_index[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the triton attention backend needs the triton package (use the torch backend)")


def _interpreting() -> bool:
    """Whether the kernels were built by the interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return type(_decode_kernel).__name__ == "InterpretedFunction"


def _compute_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast after load, tl.dot input precision). fp32 stays exact; 16-bit runs on tensor cores natively."""
    upcast = dtype == torch.float32 or _interpreting()
    return upcast, "ieee" if upcast else "tf32"


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides and a contiguous head_dim")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    _require_triton()
    _check_pool(k_cache, v_cache)
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
        BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim), num_warps=1 if head_dim <= 64 else 2)


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
    _require_triton()
    _check_pool(k_cache, v_cache)
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
    upcast, precision = _compute_flags(query.dtype)
    block_d = _next_pow2(head_dim, 16)
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, part_out, part_lse, query, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, block_size, num_heads, num_partitions, window or NO_WINDOW,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=_next_pow2(group, 16), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PARTITION_SIZE=partition_size, SINGLE_PARTITION=single, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=4 if head_dim <= 128 else 8, num_stages=2 if upcast else 3)
    if not single:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, num_heads, num_partitions, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=_next_pow2(num_partitions), num_warps=1)
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_query_len: int | None = None, window: int = 0) -> torch.Tensor:
    """Pass max_query_len when the caller knows it, to save reading cu_seqlens_q back from the device. window: as
    in paged_attention_decode, each query row's own."""
    _require_triton()
    _check_pool(k_cache, v_cache)
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
    group_pad = _next_pow2(group)
    block_q = max(1, PREFILL_BLOCK_M // group_pad)
    block_q = min(block_q, _next_pow2(max_query_len, max(1, 16 // group_pad)))  # short chunks: smaller tiles
    upcast, precision = _compute_flags(query.dtype)
    _prefill_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        out, query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        scale * LOG2E, block_size, window or NO_WINDOW, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim, 16),
        BLOCK_N=PREFILL_BLOCK_N, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=4 if head_dim <= 64 else 8, num_stages=2 if upcast else 3)  # fp32 tiles: keep shared memory low
    return out


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
    """The model runner's per-step hook (same as kernels.torch_paged.prepare)."""
    cu_seqlens_q = torch.zeros(query_lens.shape[0] + 1, dtype=torch.int32, device=query_lens.device)
    cu_seqlens_q[1:] = torch.cumsum(query_lens, 0)
    return PagedMetadata(block_tables.to(torch.int32), context_lens.to(torch.int32), cu_seqlens_q,
                         int(query_lens.max()), block_tables.shape[1] * block_size, window)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
           scale: float) -> torch.Tensor:
    """query [num_tokens, H, D] packed per sequence → [num_tokens, H, D]."""
    if meta.max_query_len == 1:
        return paged_attention_decode(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      max_context_len=meta.max_context_len, window=meta.window)
    return paged_prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.context_lens, scale, max_query_len=meta.max_query_len, window=meta.window)
