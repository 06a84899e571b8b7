"""The prefix block hash, part of the contract: router and scheduler must compute it identically.

h(-1) = xxh3_64(model name, seed[, LoRA adapter][, cache salt]);  h(i) = xxh3_64(h(i-1) as 8 LE bytes || token ids
of block i as u32 LE) over full blocks only. A block's hash therefore names the whole prefix up to and including that
block, and, through the root, the adapter it was computed with and the request's cache salt: KV is never shared
between adapters, or with the base model, or between requests of different salts (vLLM's `cache_salt`: a tenant's
prompts cannot be guessed from another's cache hits).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash


def root_hash(model_name: str, seed: int = 0, adapter: str = "", salt: str = "") -> int:
    """The chain's root: the base model's (adapter "") or one LoRA adapter's of it, salted where a salt is given."""
    key = f"ferry:{model_name}:{seed}:lora:{adapter}" if adapter else f"ferry:{model_name}:{seed}"
    if salt:
        key += f":salt:{salt}"
    return xxhash.xxh3_64_intdigest(key.encode())


def next_block_hash(parent: int, block_token_ids: Sequence[int]) -> int:
    payload = parent.to_bytes(8, "little") + array("I", block_token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(payload)


def hash_blocks(token_ids: Sequence[int], block_size: int, model_name: str, seed: int = 0,
                parent: int | None = None, start_block: int = 0, adapter: str = "", salt: str = "") -> list[int]:
    """Chained hashes of the full blocks of token_ids, from block start_block on (parent = hash before it; else the
    root of the model, or of its LoRA adapter `adapter`, salted with `salt`)."""
    h = root_hash(model_name, seed, adapter, salt) if parent is None else parent
    hashes = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        h = next_block_hash(h, token_ids[start:start + block_size])
        hashes.append(h)
    return hashes
