"""A worker's KV blocks out and in, for KV transfer between schedulers (scheduler/kv_transfer.py).

A block travels as every pool's share of it, one after another: this process's pool, its draft model's pool (which
holds the same blocks), then each other tensor-parallel rank's pool (their KV heads, through the followers' side
pipes: parallel/group.py). Blocks move only between workers of one layout (scheduler.proto's KvLayout: the same
shares of the same sizes), so both ends cut the bytes at the same places."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy

from gpu_worker.kv_pool import KVPool
from gpu_worker.parallel.group import Followers


@dataclass
class WorkerBlocks:
    pools: list[KVPool]                 # this process's: the model's, then a draft model's
    followers: Followers | None = None  # rank 0's other ranks, each holding a pool like pools[0]

    @property
    def bytes_per_block(self) -> int:
        own = sum(pool.bytes_per_block for pool in self.pools)
        return own + self.num_followers * self.pools[0].bytes_per_block

    @property
    def num_followers(self) -> int:
        return len(self.followers.processes) if self.followers is not None else 0

    def read(self, block_ids: list[int], shm_path: str = "") -> bytes:
        """The blocks' bytes; written to the new file shm_path instead where given (b"" returned)."""
        parts = [pool.read_raw(block_ids) for pool in self.pools]
        if self.followers is not None:
            parts += [numpy.frombuffer(data, dtype=numpy.uint8) for data in self.followers.read_blocks(block_ids)]
        if shm_path:
            with open(shm_path, "wb") as file:
                for part in parts:
                    part.tofile(file)
            return b""
        return parts[0].tobytes() if len(parts) == 1 else b"".join(part.tobytes() for part in parts)

    def write(self, block_ids: list[int], data: bytes, shm_path: str = "") -> None:
        """read's bytes (of another worker of this layout) into these blocks, from data or the file shm_path
        (removed once read); ValueError if the size is not theirs."""
        if shm_path:
            raw = numpy.fromfile(shm_path, dtype=numpy.uint8)
            os.unlink(shm_path)
        else:
            raw = numpy.frombuffer(bytearray(data), dtype=numpy.uint8)
        if raw.size != len(block_ids) * self.bytes_per_block:
            raise ValueError(f"KV data of {raw.size} bytes for {len(block_ids)} blocks of {self.bytes_per_block}")
        offset = 0
        for pool in self.pools:
            size = len(block_ids) * pool.bytes_per_block
            pool.write_raw(block_ids, raw[offset:offset + size])
            offset += size
        if self.followers is not None:
            share = len(block_ids) * self.pools[0].bytes_per_block
            self.followers.write_blocks(block_ids, [raw[start:start + share].tobytes()
                                                    for start in range(offset, raw.size, share)])
