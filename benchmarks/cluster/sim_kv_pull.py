"""A pulled prefix in the cluster simulation (issue 42): a scheduler the router gives a kv_source reads the holder's
blocks over a link instead of prefilling them.

The request waits for its transfer (the receiver's steps go on: a transfer never blocks its step loop), then enters
the receiver's queue with the blocks in its pool and prefix cache as if computed there (the real puller's reserve
and adopt, chunk by chunk), so the real scheduler finds them as a prefix hit. The holder pins the blocks it still
holds for as long as they are read (a block it evicted before the pull began is not sent: the receiver recomputes
from there). Each holder sends one pull at a time over its link, `kv_pull_bytes_per_s`, after `kv_pull_latency_s` to
set the pull up; the holder's own steps are not slowed (the copy is the worker's, off its step).
"""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks.cluster.cost_model import CostProfile
from scheduler.block_manager import BlockManager
from scheduler.kv_transfer import CHUNK_BYTES


@dataclass
class PinnedBlocks:
    """The holder's blocks a pull reads, referenced until it ends."""
    holder: BlockManager
    block_ids: list[int]
    block_hashes: list[int]

    def release(self) -> None:
        self.holder.unpin(self.block_ids)


def pin_leading(holder: BlockManager, block_hashes: list[int]) -> PinnedBlocks:
    """Pin the leading blocks of block_hashes the holder still caches (a chain stops at its first miss)."""
    ids = holder.cached_run(block_hashes)
    holder.pin(ids)
    return PinnedBlocks(holder, ids, block_hashes[:len(ids)])


def install(receiver: BlockManager, block_hashes: list[int], block_bytes: int) -> int:
    """The received blocks enter the receiver's pool and prefix cache as scheduler/kv_transfer.py's puller puts
    them there: chunk by chunk, reserve() free blocks (evicting the least recently used) and adopt() them (a hash
    already cached leaves its block plain free); a chunk the pool has no room for ends the pull there. Returns
    how many blocks it wrote (the puller's kv_pulled_blocks)."""
    per_chunk = max(1, CHUNK_BYTES // block_bytes)
    written = 0
    for start in range(0, len(block_hashes), per_chunk):
        chunk = block_hashes[start:start + per_chunk]
        block_ids = receiver.reserve(len(chunk))
        if block_ids is None:
            break
        receiver.adopt(block_ids, chunk)
        written += len(block_ids)
    return written


def transfer_seconds(profile: CostProfile, num_blocks: int) -> float:
    return profile.kv_pull_latency_s + num_blocks * profile.kv_block_bytes / profile.kv_pull_bytes_per_s


def pull_cost_fraction(profile: CostProfile, block_size: int) -> float:
    """A block's pull over its recompute, in the profile's own terms: what the router's --kv-pull-cost should be
    on that cluster (the setup latency is left out: it is not per block)."""
    return (profile.kv_block_bytes / profile.kv_pull_bytes_per_s) / (block_size * profile.prefill_token_s)
