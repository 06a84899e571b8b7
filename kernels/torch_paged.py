"""Paged attention in torch: the CPU path. Decodes go to the C++ decode kernel (kernels/cpu_decode.py) and prefill
chunks to the C++ prefill kernel (kernels/cpu_prefill.py), which read the pool in place, when they could be built;
without the prefill kernel (no vector path) prefill chunks go to the decode kernel as one decode per query row.
Without the decode kernel decodes take one gather of every context and one SDPA call, and prefill chunks are
attended one sequence at a time with batched matmuls, unpadded.

The per-step work (gather indices and masks from block tables) is done once by prepare(); every layer then
calls attend() with that metadata. A sliding window (each query sees its last `window` positions, itself
included) goes to the C++ kernel, which skips the blocks before it, or into the masks of the torch path;
prepare(masked=True) builds the masks whatever kernel could run, and attend() softcaps scores (Gemma 2) on that
path only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_decode, cpu_prefill


@dataclass
class PrefillChunk:
    """One sequence's new tokens: query rows [rows], attending to the tokens in kv_slots causally."""
    rows: slice
    kv_slots: torch.Tensor            # [context] flat slot of each context token
    blocked: torch.Tensor             # [query_len, context] True = may not attend (a later position)


@dataclass
class PrefillPlan:
    """A step with prefill chunks, for the C++ kernels: the sequences with several new tokens go to the prefill
    kernel, those with one (decodes) to the decode kernel."""
    block_tables: torch.Tensor        # the prefill chunks' sequences
    query_starts: torch.Tensor        # the first query row of each in the packed query
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    decode_rows: torch.Tensor | None  # the decodes' query rows (None: no decodes)
    decode_tables: torch.Tensor | None
    decode_lens: torch.Tensor | None


@dataclass
class PagedMetadata:
    num_seqs: int
    max_query_len: int
    kv_slots: torch.Tensor | None     # decodes: [num_seqs, max_context] flat slot of each context token (padding: 0)
    mask: torch.Tensor | None         # decodes: [num_seqs, 1, 1, max_context], True = attend; None = no padding
    prefill_chunks: list[PrefillChunk] | None = None
    block_tables: torch.Tensor | None = None  # for the C++ decode kernel
    context_lens: torch.Tensor | None = None
    window: int = 0                           # the C++ kernel's sliding window (0: none)
    prefill: PrefillPlan | None = None        # for the C++ prefill kernel


def prepare(block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
            block_size: int, window: int = 0, masked: bool = False) -> PagedMetadata:
    """block_tables [S, max_blocks]; context_lens [S] (new tokens included); query_lens [S] new tokens each."""
    device = block_tables.device
    num_seqs = block_tables.shape[0]
    max_query_len = int(query_lens.max())
    if not masked and device.type == "cpu" and cpu_decode.extension() is not None:
        if max_query_len > 1 and cpu_prefill.extension() is not None:
            return PagedMetadata(num_seqs, max_query_len, None, None, window=window,
                                 prefill=prefill_plan(block_tables, context_lens, query_lens))
        if max_query_len > 1:
            block_tables, context_lens = query_rows_as_decodes(block_tables, context_lens, query_lens)
        return PagedMetadata(int(context_lens.shape[0]), 1, None, None, None, block_tables, context_lens, window)
    if max_query_len > 1:
        return PagedMetadata(num_seqs, max_query_len, None, None,
                             prefill_chunks(block_tables, context_lens.tolist(), query_lens.tolist(), block_size,
                                            window))
    max_context = int(context_lens.max())
    span = min(window, max_context) if window else max_context
    # each sequence's last `span` positions (its first ones, padding included, when it is shorter): the blocks
    # before a window are never read, as the scheduler may have freed them
    first = (context_lens.long() - span).clamp(min=0).unsqueeze(1)                          # [S, 1]
    positions = first + torch.arange(span, device=device).unsqueeze(0)                      # [S, C]
    kv_slots = context_slots(block_tables, positions, block_size)
    key_valid = positions < context_lens.unsqueeze(1).long()
    needs_mask = masked or window > 0 or bool((context_lens != max_context).any())
    return PagedMetadata(num_seqs, 1, kv_slots, key_valid.view(num_seqs, 1, 1, -1) if needs_mask else None)


def context_slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool slot of each position of each sequence, through its block table: positions [C] (the same for
    every sequence) or [S, C] → [S, C]."""
    positions = positions.expand(block_tables.shape[0], -1)
    blocks = block_tables.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def prefill_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor) -> PrefillPlan:
    query_lens = query_lens.long()
    starts = torch.cumsum(query_lens, 0) - query_lens
    chunks = (query_lens > 1).nonzero().squeeze(1)
    decodes = (query_lens == 1).nonzero().squeeze(1)
    decode_fields = (starts[decodes], block_tables[decodes], context_lens[decodes]) if decodes.numel() else (None,) * 3
    return PrefillPlan(block_tables[chunks], starts[chunks], query_lens[chunks], context_lens[chunks], *decode_fields)


def query_rows_as_decodes(block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prefill chunk, as the decode kernel sees it: query row i of a sequence is a decode
    with the sequence's block table and a context ending at its own position. The chunk's blocks stay hot in the
    cache across its rows, so this reads little from memory, and it is several times faster than batched matmuls."""
    tables = block_tables.repeat_interleave(query_lens.long(), dim=0)
    ends = torch.cat([torch.arange(int(c) - int(q) + 1, int(c) + 1, dtype=torch.int32)
                      for c, q in zip(context_lens.tolist(), query_lens.tolist())])
    return tables, ends.to(block_tables.device)


def prefill_chunks(block_tables: torch.Tensor, context_lens: list[int], query_lens: list[int],
                   block_size: int, window: int = 0) -> list[PrefillChunk]:
    """Per sequence, not padded to the longest: padding would cost the square of the longest chunk for all."""
    device = block_tables.device
    chunks, row = [], 0
    for seq, (context, query) in enumerate(zip(context_lens, query_lens)):
        first = max(0, context - query - window + 1) if window else 0   # the first query's window
        positions = torch.arange(first, context, device=device)
        slots = context_slots(block_tables[seq:seq + 1], positions, block_size)[0]
        query_positions = torch.arange(context - query, context, device=device)
        blocked = positions.unsqueeze(0) > query_positions.unsqueeze(1)
        if window:
            blocked |= positions.unsqueeze(0) <= query_positions.unsqueeze(1) - window
        chunks.append(PrefillChunk(slice(row, row + query), slots, blocked))
        row += query
    return chunks


def pads_decodes() -> bool:
    """True when decodes take the gather + SDPA path, which pads every sequence to the longest context."""
    return cpu_decode.extension() is None


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
           scale: float, softcap: float = 0.0) -> torch.Tensor:
    """query [num_tokens, H, D] packed per sequence → [num_tokens, H, D]. softcap needs metadata from
    prepare(masked=True)."""
    if meta.prefill is not None:
        return attend_prefill_plan(query, k_cache, v_cache, meta.prefill, scale, meta.window)
    if meta.prefill_chunks is not None:
        return torch.cat([attend_prefill_chunk(query[c.rows], k_cache, v_cache, c, scale, softcap)
                          for c in meta.prefill_chunks])
    if meta.block_tables is not None:
        return cpu_decode.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                       window=meta.window)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    keys = gather_context(k_cache, meta.kv_slots)
    values = gather_context(v_cache, meta.kv_slots)
    # One token per sequence: the query heads sharing a KV head act as that head's query rows, which keeps
    # SDPA on its dense path (no GQA expansion).
    q = query.view(meta.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap:
        out = softcapped_attention(q, keys, values, meta.mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.mask, scale=scale)
    return out.reshape(meta.num_seqs, num_heads, head_dim)


def attend_prefill_plan(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan,
                        scale: float, window: int) -> torch.Tensor:
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    cpu_prefill.paged_prefill(query, k_cache, v_cache, plan.block_tables, plan.query_starts, plan.query_lens,
                              plan.context_lens, scale, window, out)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = cpu_decode.paged_decode(query[plan.decode_rows], k_cache, v_cache, plan.decode_tables,
                                                        plan.decode_lens, scale, window=window)
    return out


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                         scale: float, softcap: float) -> torch.Tensor:
    """q [..., Q, D], keys/values [..., C, D], visible broadcastable to [..., Q, C]: scores capped at softcap
    (cap * tanh(s / cap)) before the mask, in float32, as Gemma 2 computes them."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)).mul_(scale)
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def attend_prefill_chunk(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk,
                         scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Plain batched matmuls, one batch entry per KV head with its query heads stacked as rows: at these sizes
    this is several times faster on CPU than SDPA's flash kernel. Scores and softmax in float32."""
    query_len, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = gather_context(k_cache, chunk.kv_slots.view(1, -1))[0]          # [KVH, C, D]
    values = gather_context(v_cache, chunk.kv_slots.view(1, -1))[0]
    q = query.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)
    scores = torch.bmm(q.float(), keys.float().transpose(1, 2)).mul_(scale)   # [KVH, G * Q, C]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores.view(num_kv_heads, group, query_len, -1).masked_fill_(chunk.blocked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.bmm(probs, values)                                            # [KVH, G * Q, D]
    out = out.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3)
    return out.reshape(query_len, num_heads, head_dim)


def gather_context(cache: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """Each sequence's context from the pool (any strides) → [num_seqs, num_kv_heads, context, head_dim]."""
    block_size = cache.shape[1]
    return cache[kv_slots // block_size, kv_slots % block_size].transpose(1, 2)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, KV, D] into the pool's [blocks, block_size, KV, D] (any strides) at slot_mapping (-1: skipped)."""
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def paged_attention_decode(query, k_cache, v_cache, block_tables, context_lens, scale):
    meta = prepare(block_tables, context_lens, torch.ones_like(context_lens), k_cache.shape[1])
    return attend(query, k_cache, v_cache, meta, scale)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    query_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    meta = prepare(block_tables, context_lens, query_lens, k_cache.shape[1])
    return attend(query, k_cache, v_cache, meta, scale)
