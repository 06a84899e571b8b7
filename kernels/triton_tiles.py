"""The pieces every Triton attention kernel here is built from: loading a tile (upcast to fp32 when asked), K and V
tiles through the block table, and the online-softmax loop over a range of key positions.

Triton inlines these into the kernels that call them. Without Triton the module still imports: `triton.jit` is a
stand-in that leaves the functions as they are, and `HAS_TRITON` is False.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # CPU-only installs: keep the kernel modules importable
    HAS_TRITON = False

    class _NoTriton:
        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _NoTriton()


@triton.jit
def load_tile(ptrs, mask, UPCAST: tl.constexpr):
    """Masked-off elements read 0. UPCAST: fp32 right after the load (fp32 inputs, and the interpreter)."""
    tile = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def load_kv_tiles(k_cache_ptr, v_cache_ptr, block_table_row, positions, valid, kv_head, offs_d, d_valid, block_size,
                  stride_cb, stride_cs, stride_ch, UPCAST: tl.constexpr):
    """K and V, [BLOCK_N, BLOCK_D] each, of one KV head at the given token positions (one block-table lookup)."""
    blocks = tl.load(block_table_row + positions // block_size, mask=valid, other=0).to(tl.int64)
    rows = blocks * stride_cb + (positions % block_size) * stride_cs + kv_head * stride_ch
    offsets = rows[:, None] + offs_d[None, :]
    mask = valid[:, None] & d_valid[None, :]
    return load_tile(k_cache_ptr + offsets, mask, UPCAST), load_tile(v_cache_ptr + offsets, mask, UPCAST)


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
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
def attend_keys(q, query_positions, key_start, key_end, window, k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
                offs_d, d_valid, block_size, stride_cb, stride_cs, stride_ch, qk_scale,
                ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The ROWS query rows of q over key positions [key_start, key_end): (output, running max, sum). CAUSAL: each
    row also hides the keys after its query position and before its window; else every key in range is seen."""
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for start in range(key_start, key_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < key_end
        k, v = load_kv_tiles(k_cache_ptr, v_cache_ptr, block_table_row, positions, valid, kv_head, offs_d, d_valid,
                             block_size, stride_cb, stride_cs, stride_ch, UPCAST)
        visible = valid[None, :]
        if CAUSAL:
            visible = visible & (positions[None, :] <= query_positions[:, None])
            visible = visible & (positions[None, :] > query_positions[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None], m_i, l_i
