"""A pulled prefix in the cluster simulation (issue 42): a scheduler the router gives a kv_source reads the holder's
blocks over a link instead of prefilling them.

The request waits for its transfer (the receiver's steps go on: a transfer never blocks its step loop), then enters
the receiver's queue with the blocks in its pool and prefix cache as if computed there, so the real scheduler
finds them as a prefix hit. The holder pins the blocks it still holds for as long as they are read (a block it
evicted before the pull began is not sent: the receiver recomputes from there). Each holder sends one pull at a time
over its link, `kv_pull_bytes_per_s`, after `kv_pull_latency_s` to set the pull up; the holder's own steps are not
slowed (the copy is the worker's, off its step).
"""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks.cluster.cost_model import CostProfile
from scheduler.block_manager import BlockManager


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


def install(receiver: BlockManager, block_hashes: list[int]) -> int:
    """The received blocks enter the receiver's pool and prefix cache, unreferenced (as a finished prefill leaves
    them), evicting its least recently used free blocks for room. Returns how many it stored."""
    stored = 0
    for block_hash in block_hashes[:len(receiver.free_queue)]:   # never evicting a block this pull brought
        if block_hash in receiver.cached:
            continue
        if not receiver.free_queue:
            break
        block_id = receiver.pop_free()
        receiver.blocks[block_id].block_hash = block_hash
        receiver.cached[block_hash] = block_id
        receiver.stored_events.append(block_hash)
        receiver.release_block(block_id)
        stored += 1
    return stored


def transfer_seconds(profile: CostProfile, num_blocks: int) -> float:
    return profile.kv_pull_latency_s + num_blocks * profile.kv_block_bytes / profile.kv_pull_bytes_per_s


def pull_cost_fraction(profile: CostProfile, block_size: int) -> float:
    """A block's pull over its recompute, in the profile's own terms: what the router's --kv-pull-cost should be
    on that cluster (the setup latency is left out: it is not per block)."""
    return (profile.kv_block_bytes / profile.kv_pull_bytes_per_s) / (block_size * profile.prefill_token_s)
