"""The paged KV block manager: a fixed pool, ref counts, a prefix cache by chained block hash, LRU eviction,
copy-on-write for shared partly filled blocks."""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from protos.block_hash import next_block_hash
from scheduler.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None   # set once the block is full and registered in the prefix cache


@dataclass
class PrefixCacheCounters:
    queries: int = 0      # prompt tokens looked up
    hits: int = 0         # prompt tokens found
    evictions: int = 0


def kv_usage(num_free_blocks: int, num_blocks: int) -> float:
    """Fraction of KV blocks held by live sequences (free blocks that still cache a prefix count as free)."""
    return 1.0 - num_free_blocks / num_blocks if num_blocks else 0.0


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    root_hash: int
    enable_prefix_caching: bool = True
    sliding_window: int = 0            # every layer attends to its last this many positions (0: to all)
    announce_prompts: bool = False     # publish a queued prompt's blocks before computed (announce)
    counters: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Unreferenced blocks, next to be reused first; cached ones stay findable until they reach the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached: dict[int, int] = {}           # block hash -> block id
        self.announced: Counter[int] = Counter()   # block hash -> queued prompts that will compute it
        self.num_cached_free_blocks = 0            # free blocks still holding a reusable prefix
        self.pending_copies: list[tuple[int, int]] = []
        self.stored_events: list[int] = []
        self.removed_events: list[int] = []

    # --- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def most_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one sequence of num_tokens holds at once: all of them, or under a sliding window only
        those its window and one step's tokens reach (+1: a window seldom starts on a block's first slot)."""
        if not self.sliding_window:
            return self.blocks_for(num_tokens)
        return min(self.blocks_for(num_tokens), self.blocks_for(self.sliding_window + max_step_tokens) + 1)

    def usage(self) -> float:
        return kv_usage(self.num_free_blocks, self.num_blocks)

    # --- prefix cache --------------------------------------------------------------------------------
    def chain_root(self, seq: Sequence) -> int:
        """The hash before seq's first block: the model's, or its adapter's (KV is never shared across adapters)."""
        return self.root_hash if seq.hash_root is None else seq.hash_root

    def update_hashes(self, seq: Sequence) -> None:
        full = len(seq.token_ids) // self.block_size   # known tokens only: a pending one has no id yet
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else self.chain_root(seq)
            chunk = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            seq.block_hashes.append(next_block_hash(parent, chunk))

    def reusable_hashes(self, seq: Sequence) -> list[int]:
        """The hashes of seq's leading full blocks a prefix-cache hit may cover: none when seq does not read the
        cache, and never the block of its last token, which is always left to recompute."""
        if not (self.enable_prefix_caching and seq.reads_prefix_cache):
            return []
        self.update_hashes(seq)
        return seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading tokens; the last token is always left to recompute."""
        hits = []
        for block_hash in self.reusable_hashes(seq):
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly computed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_ids[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block.block_id
                if block_hash not in self.announced:
                    self.stored_events.append(block_hash)
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)
        if seq.announced_hashes and full >= len(seq.announced_hashes):
            self.withdraw(seq)

    def announce(self, seq: Sequence) -> None:
        """Publish the full blocks of seq's prompt now, before they are computed: with several router replicas, a
        queued prompt is otherwise in nobody's prefix index but its own router's, for as long as it queues."""
        if not (self.enable_prefix_caching and self.announce_prompts):
            return
        self.update_hashes(seq)
        seq.announced_hashes = list(seq.block_hashes)
        for block_hash in seq.announced_hashes:
            if not self.published(block_hash):
                self.stored_events.append(block_hash)
            self.announced[block_hash] += 1

    def withdraw(self, seq: Sequence) -> None:
        """seq's prompt is computed (its blocks are in the cache, unless already evicted) or abandoned."""
        for block_hash in seq.announced_hashes:
            self.announced[block_hash] -= 1
            if not self.announced[block_hash]:
                del self.announced[block_hash]
                if block_hash not in self.cached:
                    self.removed_events.append(block_hash)
        seq.announced_hashes = []

    def published(self, block_hash: int) -> bool:
        """What the prefix index should say this scheduler holds: cached blocks and announced ones."""
        return block_hash in self.cached or block_hash in self.announced

    def published_hashes(self) -> set[int]:
        return self.cached.keys() | self.announced.keys()

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) since the last drain, netted to disjoint lists: a hash evicted and stored again in
        between is reported stored, one stored and evicted is reported removed, whatever order they are applied in."""
        stored = list(dict.fromkeys(h for h in self.stored_events if self.published(h)))
        removed = list(dict.fromkeys(h for h in self.removed_events if not self.published(h)))
        self.stored_events, self.removed_events = [], []
        return stored, removed

    # --- KV moving between schedulers (scheduler/kv_transfer.py) ----------------------------------------
    def cached_run(self, block_hashes: list[int]) -> list[int]:
        """The blocks holding the leading run of these hashes that is cached here."""
        found = []
        for block_hash in block_hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def pin(self, block_ids: list[int]) -> None:
        """Keep blocks from being reused (evicted) until unpinned: they are being read."""
        for block_id in block_ids:
            self.take(block_id)

    def unpin(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.release_block(block_id)

    def reserve(self, count: int) -> list[int] | None:
        """count free blocks (the least recently used cached ones evicted, as any allocation does) to receive KV
        from elsewhere; None where fewer are free."""
        if count > self.num_free_blocks:
            return None
        return [self.pop_free() for _ in range(count)]

    def adopt(self, block_ids: list[int], block_hashes: list[int]) -> None:
        """Reserved blocks now hold these hashes' KV: they join the prefix cache as if computed here (free,
        most recently used); a hash already cached leaves its block plain free."""
        for block_id, block_hash in zip(block_ids, block_hashes):
            if self.enable_prefix_caching and block_hash not in self.cached:
                self.blocks[block_id].block_hash = block_hash
                self.cached[block_hash] = block_id
                self.stored_events.append(block_hash)
            self.release_block(block_id)

    # --- allocation ----------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        needed = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return needed + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Admit a waiting sequence: take its prefix hits, then fresh blocks for num_new_tokens more."""
        if not self.can_allocate(seq, hits, num_new_tokens):
            return False
        for block_id in hits:
            self.take(block_id)
        if self.enable_prefix_caching and seq.reads_prefix_cache:
            self.counters.queries += seq.num_tokens
            self.counters.hits += len(hits) * self.block_size
        seq.block_ids = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        seq.block_ids.extend(self.pop_free() for _ in range(self.blocks_for(seq.num_computed_tokens + num_new_tokens)
                                                            - len(hits)))
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more KV entries of a running sequence (copy-on-write included)."""
        write_from = max(seq.num_computed_tokens, seq.kv_present_tokens)
        write_to = seq.num_computed_tokens + num_new_tokens
        needed = max(0, self.blocks_for(write_to) - len(seq.block_ids))
        written = range(write_from // self.block_size, min((write_to - 1) // self.block_size + 1, len(seq.block_ids)))
        shared = [i for i in written if write_from < write_to and self.blocks[seq.block_ids[i]].ref_count > 1]
        if needed + len(shared) > self.num_free_blocks:
            return False
        for i in shared:
            self.copy_on_write(seq, i)
        seq.block_ids.extend(self.pop_free() for _ in range(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """child shares parent's blocks holding its first num_tokens tokens (those it still holds)."""
        child.block_ids = parent.block_ids[:math.ceil(num_tokens / self.block_size)]
        child.num_freed_blocks = min(parent.num_freed_blocks, len(child.block_ids))
        for block_id in child.block_ids[child.num_freed_blocks:]:
            self.blocks[block_id].ref_count += 1
        child.block_hashes = parent.block_hashes[:num_tokens // self.block_size]
        child.num_registered_blocks = min(parent.num_registered_blocks, len(child.block_hashes))

    def free(self, seq: Sequence) -> None:
        # A prompt preempted before it was computed is withdrawn too: its recompute is not announced again.
        self.withdraw(seq)
        # The tail blocks go in last-freed-first: they are the least likely to be shared again.
        for block_id in reversed(seq.block_ids[seq.num_freed_blocks:]):
            self.release_block(block_id)
        seq.block_ids = []
        seq.num_freed_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_blocks_sent = 0
        seq.kv_present_tokens = 0

    def trim(self, seq: Sequence, lookahead: int = 0) -> None:
        """Give back seq's blocks past the positions of its known tokens (and lookahead more): they held rejected
        proposals' KV. The worker is sent the whole table next (it may hold the ids given back)."""
        keep = max(self.blocks_for(len(seq.token_ids) + lookahead), seq.num_freed_blocks)
        if keep >= len(seq.block_ids):
            return
        for block_id in reversed(seq.block_ids[keep:]):
            self.release_block(block_id)
        del seq.block_ids[keep:]
        seq.block_table_replaced |= keep < seq.num_blocks_sent
        seq.num_blocks_sent = min(seq.num_blocks_sent, keep)

    def free_blocks_before_window(self, seq: Sequence) -> None:
        """Give back seq's blocks wholly before the window of its next token, which no layer reads again. Their
        ids stay in seq.block_ids (positions keep their index) and the worker's table: the kernels skip them."""
        if not self.sliding_window:
            return
        first_needed = seq.num_computed_tokens - self.sliding_window + 1
        for index in range(seq.num_freed_blocks, max(0, first_needed) // self.block_size):
            self.release_block(seq.block_ids[index])
        seq.num_freed_blocks = max(seq.num_freed_blocks, first_needed // self.block_size)

    def num_held_blocks(self, seq: Sequence) -> int:
        return len(seq.block_ids) - seq.num_freed_blocks

    # --- internals -----------------------------------------------------------------------------------
    def release_block(self, block_id: int) -> None:
        """Drop one reference; a block left unreferenced stays findable by its hash until it is reused."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)
            else:
                self.num_cached_free_blocks += 1

    def take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
            self.num_cached_free_blocks -= block.block_hash is not None
        block.ref_count += 1

    def pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            self.removed_events.append(block.block_hash)
            self.counters.evictions += 1
            self.num_cached_free_blocks -= 1
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def copy_on_write(self, seq: Sequence, index: int) -> None:
        src = seq.block_ids[index]
        dst = self.pop_free()
        self.blocks[src].ref_count -= 1
        seq.block_ids[index] = dst
        if index < seq.num_blocks_sent:  # the worker holds the old table: send it the whole new one
            seq.block_table_replaced = True
        self.pending_copies.append((src, dst))
