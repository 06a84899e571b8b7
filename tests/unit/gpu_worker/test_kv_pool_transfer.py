"""The KV pools' blocks out and in (KV transfer between schedulers): the bytes of some blocks written into other
blocks of another worker's pools make those blocks equal, as bytes and through a shared-memory file (removed once
read), a draft model's pool travelling with the target's; data of the wrong size is refused."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from gpu_worker.kv_blocks import WorkerBlocks
from gpu_worker.kv_pool import KVPool
from gpu_worker.model import ModelShape

SHAPE = ModelShape(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, rms_norm_eps=1e-5, attention_bias=False, tie_word_embeddings=False,
                   max_position_embeddings=64)
DRAFT_SHAPE = replace(SHAPE, num_layers=1, num_kv_heads=1)


def pool(shape: ModelShape, dtype: torch.dtype, filled: bool) -> KVPool:
    made = KVPool.of_blocks(shape, 4, 8, dtype, torch.device("cpu"))
    if filled:
        made.tensor.copy_(torch.randn(made.tensor.shape).to(dtype))
    return made


def workers(dtype: torch.dtype, shapes=(SHAPE,)) -> tuple[WorkerBlocks, WorkerBlocks]:
    return (WorkerBlocks([pool(shape, dtype, True) for shape in shapes]),
            WorkerBlocks([pool(shape, dtype, False) for shape in shapes]))


def equal_blocks(source: WorkerBlocks, target: WorkerBlocks, source_id: int, target_id: int) -> bool:
    return all(torch.equal(t.tensor[:, :, target_id], s.tensor[:, :, source_id])
               for s, t in zip(source.pools, target.pools))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_read_from_one_worker_and_written_into_another_are_equal(dtype):
    source, target = workers(dtype)
    target.write([6, 0], source.read([2, 5]))
    assert equal_blocks(source, target, 2, 6) and equal_blocks(source, target, 5, 0)
    assert not target.pools[0].tensor[:, :, 1].any()


def test_a_draft_models_blocks_travel_with_the_targets():
    source, target = workers(torch.bfloat16, (SHAPE, DRAFT_SHAPE))
    data = source.read([1, 3])
    assert len(data) == 2 * source.bytes_per_block == 2 * sum(p.bytes_per_block for p in source.pools)
    target.write([0, 7], data)
    assert equal_blocks(source, target, 1, 0) and equal_blocks(source, target, 3, 7)


def test_blocks_through_a_shared_memory_file_which_the_reader_removes(tmp_path):
    source, target = workers(torch.bfloat16, (SHAPE, DRAFT_SHAPE))
    path = str(tmp_path / "chunk")
    assert source.read([3], path) == b""
    target.write([4], b"", path)
    assert equal_blocks(source, target, 3, 4)
    assert not os.path.exists(path)


def test_data_of_the_wrong_size_is_refused():
    source, target = workers(torch.float32)
    with pytest.raises(ValueError, match="for 2 blocks"):
        target.write([0, 1], source.read([0]))
    with_draft = WorkerBlocks([pool(SHAPE, torch.float32, False), pool(DRAFT_SHAPE, torch.float32, False)])
    with pytest.raises(ValueError, match="for 1 blocks"):
        with_draft.write([0], source.read([0]))
