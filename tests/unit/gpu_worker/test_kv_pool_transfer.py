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


def rank_pools(shape: ModelShape, size: int, dtype: torch.dtype = torch.float32) -> list[KVPool]:
    """Each rank's pool of a group of `size` (their heads: parallel/sharding.py's cut), filled at random."""
    local = replace(shape, num_kv_heads=max(1, shape.num_kv_heads // size))
    return [pool(local, dtype, True) for _ in range(size)]


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["a head each", "one head, replicated"])
def test_blocks_of_a_group_of_two_ranks_are_gathered_into_one_ranks_heads(kv_heads):
    shape = replace(SHAPE, num_kv_heads=kv_heads)
    ranks, draft = rank_pools(shape, 2), pool(DRAFT_SHAPE, torch.float32, True)
    data = b"".join([ranks[0].read_raw([2, 5]).tobytes(), draft.read_raw([2, 5]).tobytes(),
                     ranks[1].read_raw([2, 5]).tobytes()])   # as rank 0 of that group sends them
    target = WorkerBlocks([pool(shape, torch.float32, False), pool(DRAFT_SHAPE, torch.float32, False)],
                          num_kv_heads=kv_heads)
    target.write([6, 0], data, source_size=2)
    for source_id, target_id in ((2, 6), (5, 0)):
        whole = target.pools[0].tensor[:, :, target_id]
        assert torch.equal(whole[:, :, 0], ranks[0].tensor[:, :, source_id, 0])
        if kv_heads == 2:
            assert torch.equal(whole[:, :, 1], ranks[1].tensor[:, :, source_id, 0])
        assert torch.equal(target.pools[1].tensor[:, :, target_id], draft.tensor[:, :, source_id])
    with pytest.raises(ValueError, match="group of 2 ranks"):
        target.write([1], data, source_size=2)
