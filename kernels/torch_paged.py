"""Paged attention in vectorised torch: the CPU path. One gather of the context per layer, one SDPA call;
decodes go to the C++ kernel (kernels/cpu_decode.py), which reads the pool in place, when it could be built.

The per-step work (gather indices and masks from block tables) is done once by prepare(); every layer then
calls attend() with that metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_decode


@dataclass
class PagedMetadata:
    num_seqs: int
    max_query_len: int
    kv_slots: torch.Tensor            # [num_seqs, max_context] flat slot of each context token (padding: 0)
    mask: torch.Tensor | None         # [num_seqs, 1, max_query_len, max_context], True = attend; None = no padding
    query_pad_index: torch.Tensor | None   # [num_seqs * max_query_len] packed query row per padded position
    query_unpad_index: torch.Tensor | None  # [num_tokens] padded position of each packed query row
    block_tables: torch.Tensor | None = None  # for the C++ decode kernel
    context_lens: torch.Tensor | None = None


def prepare(block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
            block_size: int) -> PagedMetadata:
    """block_tables [S, max_blocks]; context_lens [S] (new tokens included); query_lens [S] new tokens each."""
    device = block_tables.device
    num_seqs = block_tables.shape[0]
    max_query_len = int(query_lens.max())
    if max_query_len == 1 and device.type == "cpu" and cpu_decode.extension() is not None:
        return PagedMetadata(num_seqs, 1, None, None, None, None, block_tables, context_lens)
    max_context = int(context_lens.max())
    positions = torch.arange(max_context, device=device)
    blocks = block_tables.long().gather(1, (positions // block_size).expand(num_seqs, -1))
    kv_slots = blocks * block_size + positions % block_size
    key_valid = positions.unsqueeze(0) < context_lens.unsqueeze(1).long()                  # [S, C]
    query_pos = torch.arange(max_query_len, device=device)
    first_query_pos = (context_lens - query_lens).long().unsqueeze(1)                       # [S, 1]
    causal = positions.view(1, 1, -1) <= (first_query_pos + query_pos.unsqueeze(0)).unsqueeze(2)  # [S, Q, C]
    mask = (causal & key_valid.unsqueeze(1)).unsqueeze(1)
    needs_mask = bool((context_lens != max_context).any()) or max_query_len > 1
    if max_query_len == 1:
        return PagedMetadata(num_seqs, 1, kv_slots, mask if needs_mask else None, None, None)
    query_valid = query_pos.unsqueeze(0) < query_lens.unsqueeze(1)                          # [S, Q]
    starts = torch.cumsum(query_lens, 0) - query_lens
    pad_index = (starts.unsqueeze(1) + query_pos.unsqueeze(0)).masked_fill(~query_valid, 0).reshape(-1)
    mask = mask | ~query_valid.view(num_seqs, 1, max_query_len, 1)  # padded query rows attend anywhere: no NaN
    unpad_index = torch.nonzero(query_valid.reshape(-1)).squeeze(1)
    return PagedMetadata(num_seqs, max_query_len, kv_slots, mask, pad_index, unpad_index)


def pads_decodes() -> bool:
    """True when decodes take the gather + SDPA path, which pads every sequence to the longest context."""
    return cpu_decode.extension() is None


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
           scale: float) -> torch.Tensor:
    """query [num_tokens, H, D] packed per sequence → [num_tokens, H, D]."""
    if meta.block_tables is not None:
        return cpu_decode.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    keys = gather_context(k_cache, meta)
    values = gather_context(v_cache, meta)
    if meta.max_query_len == 1:
        # One token per sequence: the query heads sharing a KV head act as that head's query rows, which keeps
        # SDPA on its dense path (no GQA expansion).
        q = query.view(meta.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.mask, scale=scale)
        return out.reshape(meta.num_seqs, num_heads, head_dim)
    q = query[meta.query_pad_index].view(meta.num_seqs, meta.max_query_len, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)[meta.query_unpad_index]


def gather_context(cache: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
    """Every sequence's context from the pool → [num_seqs, num_kv_heads, max_context, head_dim] (a view)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    rows = cache.view(-1, num_kv_heads * head_dim).index_select(0, meta.kv_slots.view(-1))  # whole-token rows: fast
    return rows.view(meta.num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention_decode(query, k_cache, v_cache, block_tables, context_lens, scale):
    meta = prepare(block_tables, context_lens, torch.ones_like(context_lens), k_cache.shape[1])
    return attend(query, k_cache, v_cache, meta, scale)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    query_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    meta = prepare(block_tables, context_lens, query_lens, k_cache.shape[1])
    return attend(query, k_cache, v_cache, meta, scale)
