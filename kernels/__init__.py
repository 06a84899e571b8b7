"""Attention over the paged KV pool: Triton kernels on CUDA, a vectorised torch path on CPU.

Pool layout, per layer: k_cache / v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim], any strides
with a contiguous head_dim (the worker's pool is head-major inside a block, seen through a transposed view).
A token at position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.

The three operations (same signatures in every backend):
  store_kv(key, value, k_cache, v_cache, slot_mapping)
      key/value [num_tokens, num_kv_heads, head_dim]; slot_mapping [num_tokens] int64, -1 = skip (padding).
  paged_attention_decode(query, k_cache, v_cache, block_tables, context_lens, scale) -> out
      query [num_seqs, num_heads, head_dim], one token per sequence, attending to context_lens[i] tokens
      (its own K/V already stored); block_tables [num_seqs, max_blocks] int32; context_lens [num_seqs] int32.
  paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale) -> out
      query [num_tokens, num_heads, head_dim]: the new tokens of many sequences packed (cu_seqlens_q
      [num_seqs + 1] int32); sequence i's new tokens are its last (cu_seqlens_q[i+1] - cu_seqlens_q[i]) of
      context_lens[i] tokens, all already stored; causal.
"""
from __future__ import annotations

from types import ModuleType


def select_backend(name: str, device_type: str) -> ModuleType:
    """'auto' picks Triton on CUDA and torch elsewhere; 'torch' / 'triton' force one."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        from kernels import torch_paged
        return torch_paged
    if name == "triton":
        from kernels import triton_paged
        return triton_paged
    raise ValueError(f"unknown attention backend {name!r} (auto, torch or triton)")
