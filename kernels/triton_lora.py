"""The LoRA products of one step in Triton (Punica's SGMV, vLLM's lora_shrink / lora_expand): the semantics are
kernels/torch_lora.py's, which this keeps.

One kernel, launched twice, each over (segment, tile of its rows, tile of the output's columns), rows gathered through
`rows.order`: shrink writes x A^T of every row with an adapter into an fp32 buffer [rows with an adapter, R], in
`order`'s order; expand adds that buffer times B^T into the rows of `out`. Rows are distinct, so no atomics. The
grid is sized by the host's segment lengths (in a CUDA graph, bounds of them: every segment as long as the
batch): no launch reads the device. Programs past a segment's end return.
"""
from __future__ import annotations

import torch

from kernels.torch_lora import LoraRows
from kernels.triton_launch import compute_flags, next_pow2, require_triton
from kernels.triton_tiles import load_tile, tl, triton

LORA_BLOCK_M = 64   # rows of a segment per program
LORA_BLOCK_K = 64   # shrink: the reduction over x's columns
LORA_BLOCK_N = 64   # expand: out's columns per program
LORA_BLOCK_R = 64   # the rank: shrink's output columns per program, expand's reduction
DECODE_ROWS = 256   # steps of at most this many rows with an adapter take row tiles of 16


@triton.jit
def _segment_rows(order_ptr, seg_starts_ptr, seg_lengths_ptr, seg_slots_ptr, BLOCK_M: tl.constexpr):
    """This program's row tile of its segment (program ids 0 and 1): (whether the tile holds any row, positions in
    order and the buffer, the rows themselves, which are real, the segment's slot)."""
    seg = tl.program_id(0)
    row_tile = tl.program_id(1)
    length = tl.load(seg_lengths_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    offs_m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < length
    positions = start + offs_m
    rows = tl.load(order_ptr + positions, mask=valid, other=0).to(tl.int64)
    return row_tile * BLOCK_M < length, positions, rows, valid, tl.load(seg_slots_ptr + seg).to(tl.int64)


@triton.jit
def _segment_matmul_kernel(out_ptr, x_ptr, w_ptr, order_ptr, seg_starts_ptr, seg_lengths_ptr, seg_slots_ptr, K, N,
                           stride_xt, stride_xk, stride_ot, stride_on, stride_ws, stride_wn, stride_wk,
                           SHRINK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of x @ W[slot]^T for a segment's rows. SHRINK: x's gathered rows in, the buffer's rows (positions
    in `order`) written; otherwise the buffer's rows in, added into out's gathered rows."""
    live, positions, rows, m_valid, slot = _segment_rows(order_ptr, seg_starts_ptr, seg_lengths_ptr, seg_slots_ptr,
                                                         BLOCK_M)
    if not live:
        return
    if SHRINK:
        x_rows = rows
        out_rows = positions
    else:
        x_rows = positions
        out_rows = rows
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xt + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # W^T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_valid = k + offs_k < K
        x = load_tile(x_ptrs, m_valid[:, None] & k_valid[None, :], UPCAST)
        w = load_tile(w_ptrs, k_valid[:, None] & n_valid[None, :], UPCAST)
        if not UPCAST:
            x = x.to(w.dtype)  # expand's fp32 buffer times 16-bit weights: the tensor cores' inputs, as torch rounds
        acc = tl.dot(x, w, acc=acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + out_rows[:, None] * stride_ot + offs_n[None, :] * stride_on
    mask = m_valid[:, None] & n_valid[None, :]
    if SHRINK:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        base = load_tile(out_ptrs, mask, True)
        tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             rows: LoraRows) -> None:
    """out[r] += (x[r] @ a_stack[slot].T) @ b_stack[slot].T for every row r of every segment, in place (as
    kernels.torch_lora.add_lora). x [T, K], out [T, N] (any strides: out may be a view), a_stack [S, R, K],
    b_stack [S, N, R]; rows outside every segment keep the base layer's output."""
    require_triton()
    if not rows.lengths:
        return
    num_rows, width = rows.order.shape[0], a_stack.shape[1]
    in_features, out_features = x.shape[1], out.shape[1]
    # a decode step's rows in tiles of 16: one adapter's 64 rows are then 4 programs, not 1 doing all of shrink
    block_m = 16 if num_rows <= DECODE_ROWS else min(LORA_BLOCK_M, next_pow2(max(rows.lengths), 16))
    block_r = min(LORA_BLOCK_R, next_pow2(width, 16))
    upcast, precision = compute_flags(x.dtype)
    stages = 2 if upcast else 3   # fp32 tiles: keep shared memory low
    buffer = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    segments = (len(rows.lengths), triton.cdiv(max(rows.lengths), block_m))
    _segment_matmul_kernel[segments + (triton.cdiv(width, block_r),)](
        buffer, x, a_stack, rows.order, rows.seg_starts, rows.seg_lengths, rows.seg_slots, in_features, width,
        x.stride(0), x.stride(1), buffer.stride(0), buffer.stride(1),
        a_stack.stride(0), a_stack.stride(1), a_stack.stride(2),
        SHRINK=True, BLOCK_M=block_m, BLOCK_N=block_r, BLOCK_K=min(LORA_BLOCK_K, next_pow2(in_features, 16)),
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=4, num_stages=stages)
    block_n = min(LORA_BLOCK_N, next_pow2(out_features, 16))
    _segment_matmul_kernel[segments + (triton.cdiv(out_features, block_n),)](
        out, buffer, b_stack, rows.order, rows.seg_starts, rows.seg_lengths, rows.seg_slots, width, out_features,
        buffer.stride(0), buffer.stride(1), out.stride(0), out.stride(1),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        SHRINK=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_r, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=4, num_stages=stages)
