"""A worker's KV blocks out and in, for KV transfer between schedulers (scheduler/kv_transfer.py).

A block travels as every pool's share of it, one after another: this process's pool, its draft model's pool (which
holds the same blocks), then each other tensor-parallel rank's pool (their KV heads). Blocks move only between
workers of one layout (scheduler.proto's KvLayout: the same shares of the same sizes), so both ends cut the bytes at
the same places; but for groups of other sizes, whose shares the receiver gathers into every KV head and cuts again
as its own ranks hold them. Through a shared-memory chunk file each follower writes or reads its own share at its
offset in the file; as bytes, the shares cross the followers' side pipes (parallel/group.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy

from gpu_worker.kv_pool import KVPool
from gpu_worker.parallel.group import Followers
from gpu_worker.parallel.sharding import rank_heads


ELEMENT_TYPES = {2: numpy.uint16, 4: numpy.uint32}   # a KV element's bytes, moved but never computed with


@dataclass
class WorkerBlocks:
    pools: list[KVPool]                 # this process's: the model's, then a draft model's
    followers: Followers | None = None  # rank 0's other ranks, each holding a pool like pools[0]
    num_kv_heads: int = 0               # the whole model's (0: pools[0]'s, one rank)

    @property
    def bytes_per_block(self) -> int:
        return self.own_bytes_per_block + self.num_followers * self.pools[0].bytes_per_block

    @property
    def own_bytes_per_block(self) -> int:
        return sum(pool.bytes_per_block for pool in self.pools)

    @property
    def group_size(self) -> int:
        return self.num_followers + 1

    @property
    def num_followers(self) -> int:
        return len(self.followers.processes) if self.followers is not None else 0

    def follower_offsets(self, num_blocks: int) -> list[int]:
        """Where each follower's share of num_blocks blocks starts in the bytes."""
        share = num_blocks * self.pools[0].bytes_per_block
        return [num_blocks * self.own_bytes_per_block + i * share for i in range(self.num_followers)]

    def read(self, block_ids: list[int], shm_path: str = "") -> bytes:
        """The blocks' bytes; written to the new file shm_path instead where given (b"" returned)."""
        parts = [pool.read_raw(block_ids) for pool in self.pools]
        if shm_path:
            with open(shm_path, "wb") as file:
                for part in parts:
                    part.tofile(file)
            if self.followers is not None:
                try:
                    self.followers.read_blocks(block_ids, shm_path, self.follower_offsets(len(block_ids)))
                except ValueError:
                    os.unlink(shm_path)   # half written: no puller will read it
                    raise
            return b""
        if self.followers is not None:
            parts += [numpy.frombuffer(data, dtype=numpy.uint8) for data in self.followers.read_blocks(block_ids)]
        return parts[0].tobytes() if len(parts) == 1 else b"".join(part.tobytes() for part in parts)

    def write(self, block_ids: list[int], data: bytes, shm_path: str = "", source_size: int = 0) -> None:
        """read's bytes (of another worker of this layout, or of a group of source_size ranks) into these blocks,
        from data or the file shm_path (removed once read); ValueError if the size is not theirs."""
        try:
            if source_size and source_size != self.group_size:
                raw = numpy.fromfile(shm_path, dtype=numpy.uint8) if shm_path else numpy.frombuffer(
                    bytearray(data), dtype=numpy.uint8)
                self.write_recut(block_ids, raw, source_size)
                return
            raw = self.own_bytes(block_ids, data, shm_path)
            write_in_turn(self.pools, block_ids, raw)
            if self.followers is not None:
                self.write_followers(block_ids, raw, shm_path)
        finally:
            if shm_path:
                os.unlink(shm_path)

    def own_bytes(self, block_ids: list[int], data: bytes, shm_path: str) -> numpy.ndarray:
        """The bytes, but for the followers' shares where they are in a file (each reads its own); ValueError if
        the total is not these blocks'."""
        expected = len(block_ids) * self.bytes_per_block
        total = os.path.getsize(shm_path) if shm_path else len(data)
        if total != expected:
            raise ValueError(f"KV data of {total} bytes for {len(block_ids)} blocks of {self.bytes_per_block}")
        if not shm_path:
            return numpy.frombuffer(bytearray(data), dtype=numpy.uint8)
        return numpy.fromfile(shm_path, dtype=numpy.uint8, count=len(block_ids) * self.own_bytes_per_block)

    def write_followers(self, block_ids: list[int], raw: numpy.ndarray, shm_path: str) -> None:
        offsets = self.follower_offsets(len(block_ids))
        if shm_path:
            self.followers.write_blocks(block_ids, offsets=offsets, shm_path=shm_path)
            return
        share = len(block_ids) * self.pools[0].bytes_per_block
        self.followers.write_blocks(block_ids, shares=[raw[start:start + share].tobytes() for start in offsets])

    def write_recut(self, block_ids: list[int], raw: numpy.ndarray, source_size: int) -> None:
        """The bytes of a group of source_size ranks: every KV head gathered from their shares (after rank 0's, its
        draft model's whole pool), then cut as this group's ranks hold them."""
        n = len(block_ids)
        layers, kinds, _, _, block_size, head_dim = self.pools[0].tensor.shape
        element = self.pools[0].tensor.element_size()
        heads = self.num_kv_heads or self.pools[0].tensor.shape[3]
        source_heads = max(1, heads // source_size)
        share = n * layers * kinds * source_heads * block_size * head_dim * element
        draft = n * sum(pool.bytes_per_block for pool in self.pools[1:])
        if raw.size != source_size * share + draft:
            raise ValueError(f"KV data of {raw.size} bytes for {n} blocks of a group of {source_size} ranks: "
                             f"{source_size * share + draft} expected")
        starts = [0] + [share + draft + (rank - 1) * share for rank in range(1, source_size)]
        shares = [raw[start:start + share].view(ELEMENT_TYPES[element]).reshape(
            layers, kinds, n, source_heads, block_size, head_dim) for start in starts]
        taken: dict[int, numpy.ndarray] = {}
        for rank, part in enumerate(shares):
            for index, head in enumerate(rank_heads(rank, source_size, heads)):
                taken.setdefault(head, part[:, :, :, index])
        whole = numpy.stack([taken[head] for head in range(heads)], axis=3)
        mine = [heads_bytes(whole, rank_heads(rank, self.group_size, heads)) for rank in range(self.group_size)]
        self.pools[0].write_raw(block_ids, mine[0])
        write_in_turn(self.pools[1:], block_ids, raw[share:])
        if self.followers is not None:
            self.followers.write_blocks(block_ids, shares=[part.tobytes() for part in mine[1:]])


def heads_bytes(whole: numpy.ndarray, heads: range) -> numpy.ndarray:
    """Those heads of [layers, K and V, blocks, heads, block_size, head_dim], as a rank's pool holds them in bytes."""
    return numpy.ascontiguousarray(whole[:, :, :, heads.start:heads.stop]).view(numpy.uint8).reshape(-1)


def write_in_turn(pools: list[KVPool], block_ids: list[int], raw: numpy.ndarray) -> None:
    """Each pool's bytes of the blocks, one pool's after another's, into its blocks."""
    offset = 0
    for pool in pools:
        size = len(block_ids) * pool.bytes_per_block
        pool.write_raw(block_ids, raw[offset:offset + size])
        offset += size
