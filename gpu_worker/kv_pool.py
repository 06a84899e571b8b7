"""The paged KV pool: one preallocated tensor holding every layer's K and V blocks."""
from __future__ import annotations

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

    @property
    def bytes_per_block(self) -> int:
        """One block's K and V over every layer, as read_raw gives them."""
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    def read_raw(self, block_ids: list[int]) -> numpy.ndarray:
        """Every layer's K and V of the blocks, [layers, 2, blocks, kv_heads, block_size, head_dim], as host bytes."""
        # block by block: one contiguous copy each (an index_select over the pool's middle dimension is 4x slower)
        return torch.stack([self.tensor[:, :, b] for b in block_ids], dim=2).cpu().view(torch.uint8).numpy()

    def write_raw(self, block_ids: list[int], raw: numpy.ndarray) -> None:
        """read_raw's bytes (of another pool of this layout) into these blocks; ValueError if the size is not theirs."""
        layers, kinds, _, heads, size, dim = self.tensor.shape
        if raw.size != len(block_ids) * self.bytes_per_block:
            raise ValueError(f"KV data of {raw.size} bytes for {len(block_ids)} blocks of {self.bytes_per_block}")
        shape = (layers, kinds, len(block_ids), heads, size, dim)
        blocks = torch.from_numpy(raw).view(self.tensor.dtype).view(shape).to(self.tensor.device)
        for i, block_id in enumerate(block_ids):
            self.tensor[:, :, block_id].copy_(blocks[:, :, i])
