"""Obviously-correct torch references of the paged attention operations: one sequence at a time, in fp32.

Slow on purpose; the tests hold the Triton kernels and the vectorised torch path to these.
"""
from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first context_len tokens of one sequence from a pool layer → [context_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    positions = torch.arange(context_len, device=cache.device)
    blocks = block_table.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     window: int = 0) -> torch.Tensor:
    """query [Q, H, D], keys/values [C, KV, D] with the Q queries being the last Q of the C positions; window > 0:
    each query sees its last `window` positions, itself included."""
    num_queries, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)                                         # [H, Q, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)          # [H, C, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale                                    # [H, Q, C]
    query_positions = torch.arange(context_len - num_queries, context_len, device=query.device)
    visible = torch.arange(context_len, device=query.device).unsqueeze(0) <= query_positions.unsqueeze(1)
    if window:
        visible &= torch.arange(context_len, device=query.device).unsqueeze(0) > query_positions.unsqueeze(1) - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1).to(query.dtype)      # [Q, H, D]


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[token].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = value[token].to(v_cache.dtype)


def paged_attention_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int = 0) -> torch.Tensor:
    outputs = []
    for seq, context_len in enumerate(context_lens.tolist()):
        keys = gather_context(k_cache, block_tables[seq], context_len)
        values = gather_context(v_cache, block_tables[seq], context_len)
        outputs.append(causal_attention(query[seq:seq + 1], keys, values, scale, window))
    return torch.cat(outputs)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    outputs = []
    starts = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        keys = gather_context(k_cache, block_tables[seq], context_len)
        values = gather_context(v_cache, block_tables[seq], context_len)
        outputs.append(causal_attention(query[starts[seq]:starts[seq + 1]], keys, values, scale))
    return torch.cat(outputs)
