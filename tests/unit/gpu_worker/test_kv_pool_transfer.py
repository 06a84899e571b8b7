"""The KV pool's blocks out and in (KV transfer between schedulers): the bytes of some blocks written into other
blocks of another pool make those blocks equal, as bytes and through a shared-memory file (removed once read);
data of the wrong size is refused."""
from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.kv_pool import KVPool
from gpu_worker.model import ModelShape

SHAPE = ModelShape(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, rms_norm_eps=1e-5, attention_bias=False, tie_word_embeddings=False,
                   max_position_embeddings=64)


def pools(dtype: torch.dtype) -> tuple[KVPool, KVPool]:
    source = KVPool.of_blocks(SHAPE, 4, 8, dtype, torch.device("cpu"))
    source.tensor.copy_(torch.randn(source.tensor.shape).to(dtype))
    return source, KVPool.of_blocks(SHAPE, 4, 8, dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_read_from_one_pool_and_written_into_another_are_equal(dtype):
    source, target = pools(dtype)
    target.write_blocks([6, 0], source.read_blocks([2, 5]))
    assert torch.equal(target.tensor[:, :, 6], source.tensor[:, :, 2])
    assert torch.equal(target.tensor[:, :, 0], source.tensor[:, :, 5])
    assert not target.tensor[:, :, 1].any()


def test_blocks_through_a_shared_memory_file_which_the_reader_removes(tmp_path):
    source, target = pools(torch.bfloat16)
    path = str(tmp_path / "chunk")
    assert source.read_blocks([3], path) == b""
    target.write_blocks([4], b"", path)
    assert torch.equal(target.tensor[:, :, 4], source.tensor[:, :, 3])
    assert not os.path.exists(path)


def test_data_of_the_wrong_size_is_refused():
    source, target = pools(torch.float32)
    with pytest.raises(ValueError, match="for 2 blocks"):
        target.write_blocks([0, 1], source.read_blocks([0]))
