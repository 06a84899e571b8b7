"""The paged KV pool: one preallocated tensor holding every layer's K and V blocks."""
from __future__ import annotations

import math
import os

import numpy
import torch

from gpu_worker.model import ModelShape
from kernels import cpu_decode

DEFAULT_CPU_KV_BYTES = 1 << 30   # on a GPU the pool's size comes from gpu_worker/cuda/device_memory.py


def block_bytes(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * element


class KVPool:
    def __init__(self, shape: ModelShape, block_size: int, budget_bytes: int, dtype: torch.dtype,
                 device: torch.device):
        self.block_size = block_size
        self.num_blocks = budget_bytes // block_bytes(shape, block_size, dtype)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget_bytes} bytes holds no block of {block_size} tokens")
        # Head-major inside a block: one KV head's keys for the block's tokens are one contiguous run (2 KiB for
        # 16 tokens of 64 bf16), which the attention reads in one stream (measured on CPU: 7% faster decode
        # attention than token-major). Every kernel takes the layers as strided [blocks, block_size, KV, D] views.
        self.tensor = torch.empty(shape.num_layers, 2, self.num_blocks, shape.num_kv_heads, block_size,
                                  shape.head_dim, dtype=dtype, device=device)
        if device.type == "cpu":
            cpu_decode.advise_huge_pages(self.tensor)   # before the first touch, or the pages stay small
        self.tensor.zero_()
        self.layers = [(self.tensor[i, 0].transpose(1, 2), self.tensor[i, 1].transpose(1, 2))
                       for i in range(shape.num_layers)]

    @classmethod
    def of_blocks(cls, shape: ModelShape, block_size: int, num_blocks: int, dtype: torch.dtype,
                  device: torch.device) -> KVPool:
        return cls(shape, block_size, num_blocks * block_bytes(shape, block_size, dtype), dtype, device)

    def copy_block(self, src: int, dst: int) -> None:
        self.tensor[:, :, dst].copy_(self.tensor[:, :, src])

    def read_blocks(self, block_ids: list[int], shm_path: str = "") -> bytes:
        """Every layer's K and V of the blocks, [layers, 2, blocks, kv_heads, block_size, head_dim], as raw bytes;
        written to shm_path instead where given (b"" returned)."""
        # block by block: one contiguous copy each (an index_select over the pool's middle dimension is 4x slower)
        raw = torch.stack([self.tensor[:, :, b] for b in block_ids], dim=2).cpu().view(torch.uint8).numpy()
        if shm_path:
            raw.tofile(shm_path)
            return b""
        return raw.tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes, shm_path: str = "") -> None:
        """read_blocks's bytes (of another pool of the same layout) into these blocks, from data or the file
        shm_path (removed once read); ValueError if the size is not theirs."""
        layers, kinds, _, heads, size, dim = self.tensor.shape
        shape = (layers, kinds, len(block_ids), heads, size, dim)
        if shm_path:
            raw = torch.from_numpy(numpy.fromfile(shm_path, dtype=numpy.uint8))
            os.unlink(shm_path)
        else:
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        expected = math.prod(shape) * self.tensor.element_size()
        if raw.numel() != expected:
            raise ValueError(f"KV data of {raw.numel()} bytes for {len(block_ids)} blocks of "
                             f"{expected // len(block_ids)}")
        blocks = raw.view(self.tensor.dtype).view(shape).to(self.tensor.device)
        for i, block_id in enumerate(block_ids):
            self.tensor[:, :, block_id].copy_(blocks[:, :, i])
