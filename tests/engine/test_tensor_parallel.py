"""Tensor parallelism on the CPU (gloo, 2 ranks): every family's output token-identical to transformers (and so
to one rank) in float32, with prefix-cache hits, preemption and seeded sampling; each rank holding about half the
weights; models that do not split refused before any rank starts."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferry import EngineConfig, SamplingParams
from tests.conftest import transformers_greedy
from tests.model_families_fixtures import FAMILIES, GREEDY, MAX_TOKENS, build_tiny_model, prompts, tiny_engine

__all__ = ["prompts"]   # the shared fixture
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_TOKENS, n=2, seed=7, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path, model = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, model


def block_bytes(engine) -> int:
    """A KV block's bytes in rank 0's pool (each rank's pool holds its own heads)."""
    return engine.worker.runner.pool.tensor[:, :, :1].numel() * 4


def samples(engine, prompts, params) -> list[list[int]]:
    return [sample.token_ids for result in engine.generate(prompts, params) for sample in result.samples]


def test_two_ranks_decode_every_family_as_transformers_with_cache_hits_and_preemption(family, prompts):
    _, model_dir, model = family
    expected = transformers_greedy(model, prompts, MAX_TOKENS)
    engine = tiny_engine(model_dir, tensor_parallel_size=2)
    assert engine.started.device_info["tensor_parallel_size"] == "2"
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    hits = engine.stats().prefix_cache_hits
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    assert engine.stats().prefix_cache_hits > hits
    num_blocks = 12 if engine.info.sliding_window else 14   # a pool that runs dry: preemptions
    small = tiny_engine(model_dir, tensor_parallel_size=2, kv_cache_memory=num_blocks * block_bytes(engine))
    assert small.info.num_blocks == num_blocks
    assert [r.token_ids for r in small.generate(prompts, GREEDY)] == expected
    assert small.stats().num_preemptions > 0


def test_seeded_sampling_with_two_samples_each_matches_one_rank(tmp_path, prompts):
    model_dir, _ = build_tiny_model(tmp_path, "qwen3")
    expected = samples(tiny_engine(model_dir), prompts, SEEDED)
    assert samples(tiny_engine(model_dir, tensor_parallel_size=2), prompts, SEEDED) == expected


def test_one_kv_head_is_replicated_and_an_odd_vocabulary_padded(tmp_path, prompts):
    """Multi-query attention: both ranks keep the one KV head; a vocabulary of odd size: rank 1's slice is one row
    short (padded, its logit dropped)."""
    model_dir, model = build_tiny_model(tmp_path, "mistral_windowed", num_key_value_heads=1, vocab_size=457)
    expected = transformers_greedy(model, prompts, MAX_TOKENS)
    engine = tiny_engine(model_dir, tensor_parallel_size=2)
    assert engine.info.vocab_size == 457
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_two_ranks_with_lora_adapters_and_base_rows_mixed_match_peft_merged_models(tmp_path, prompts, num_kv_heads):
    """Each rank runs its cut of every adapter: q|k|v's and gate|up's B by output rows, o's and down's A by input
    columns (their partial products go into the all-reduce); with one KV head, both ranks keep k's and v's whole."""
    from tests.conftest import build_tiny_llama
    from tests.lora_fixtures import build_peft_adapter, merged_model

    model_dir = build_tiny_llama(tmp_path / "model", num_key_value_heads=num_kv_heads)
    adapters = {name: str(build_peft_adapter(model_dir, tmp_path / name, rank, seed=rank))
                for name, rank in (("a4", 4), ("a8", 8))}
    names = [("a8", "", "a4")[i % 3] for i in range(len(prompts))]
    expected = {name: transformers_greedy(merged_model(model_dir, adapters.get(name)), prompts, MAX_TOKENS)
                for name in ("", "a4", "a8")}
    engine = tiny_engine(model_dir, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
                         lora_modules=[f"{name}={path}" for name, path in adapters.items()])
    results = engine.generate(prompts, GREEDY, lora_names=names)
    assert [r.token_ids for r in results] == [expected[name][i] for i, name in enumerate(names)]


def test_each_rank_holds_about_half_of_the_weights(tmp_path):
    model_dir, model = build_tiny_model(tmp_path, "qwen3")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert list(tiny_engine(model_dir).started.rank_weight_bytes) == [whole]
    ranks = tiny_engine(model_dir, tensor_parallel_size=2).started.rank_weight_bytes
    assert len(ranks) == 2
    assert all(0.5 * whole < size < 0.52 * whole for size in ranks)   # the norms are whole on every rank


def test_a_model_that_does_not_split_evenly_is_refused_before_any_rank_starts(tmp_path):
    model_dir, _ = build_tiny_model(tmp_path, "qwen3")   # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        tiny_engine(model_dir, tensor_parallel_size=3)


def test_a_tensor_parallel_size_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(tensor_parallel_size=0).validate()


def test_a_draft_model_on_rank_0_alone_keeps_two_ranks_greedy_output_and_is_accepted(tmp_path, prompts):
    """The draft runs whole on rank 0 (its pool beside rank 0's shard of the target's), proposes for the group,
    and the ranks verify together: transformers' tokens, nearly every proposal of the model itself kept."""
    import json

    from tests.conftest import build_tiny_llama
    model_dir = build_tiny_llama(tmp_path / "model")
    expected = transformers_greedy(AutoModelForCausalLM.from_pretrained(model_dir).eval(), prompts, MAX_TOKENS)
    draft = json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
                        "disable_by_batch_size": 1024})
    engine = tiny_engine(model_dir, tensor_parallel_size=2, speculative_config=draft)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    counters = engine.scheduler.counters
    assert counters.spec_accepted_tokens > 0.95 * counters.spec_proposed_tokens > 0, counters


def test_kv_blocks_out_and_in_carry_every_ranks_share_as_bytes_and_through_a_file(tmp_path, prompts):
    """KV transfer's worker side (gpu_worker/kv_blocks.py) on a group of 2: the bytes of two blocks, read as bytes
    and through a chunk file (each rank writing its share at its offset), are the same; written into other blocks
    either way, those blocks read back as the same bytes on both ranks (a rank's share read or written wrong
    changes them)."""
    model_dir, _ = build_tiny_model(tmp_path, "qwen3")
    engine = tiny_engine(model_dir, tensor_parallel_size=2)
    engine.generate(prompts, GREEDY)
    blocks = engine.worker.blocks
    data = blocks.read([0, 1])
    assert len(data) == 2 * blocks.bytes_per_block == 2 * 2 * blocks.pools[0].bytes_per_block
    half = len(data) // 2
    assert any(data[:half]) and any(data[half:])   # both ranks' shares hold KV
    chunk = tmp_path / "chunk"
    assert blocks.read([0, 1], str(chunk)) == b"" and chunk.read_bytes() == data
    blocks.write([6, 7], data)
    assert blocks.read([6, 7]) == data
    blocks.write([8, 9], b"", str(chunk))
    assert blocks.read([8, 9]) == data and not chunk.exists()


def test_kv_blocks_move_between_groups_of_two_ranks_and_one_cut_again_by_head(tmp_path, prompts):
    """A prefix's blocks read from a group of 2 and written into one rank (and back), gathered into every KV head
    and cut again: the blocks hold what the receiver computed itself for those tokens (float32, to the rounding
    of the ranks' partial sums)."""
    from protos.block_hash import hash_blocks

    model_dir, _ = build_tiny_model(tmp_path, "qwen3")
    group, single = tiny_engine(model_dir, tensor_parallel_size=2), tiny_engine(model_dir)
    for engine in (group, single):
        engine.generate(prompts, GREEDY)

    def cached_blocks(engine) -> list[int]:
        hashes = hash_blocks(prompts[-1], engine.info.block_size, engine.info.model_name)
        return engine.scheduler.block_manager.cached_run(hashes)

    def as_floats(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.float32)

    group_ids, single_ids = cached_blocks(group), cached_blocks(single)
    assert len(group_ids) == len(single_ids) >= 2
    computed_here = single.worker.blocks.read(single_ids)
    single.worker.blocks.write(single_ids, group.worker.blocks.read(group_ids), source_size=2)
    assert torch.allclose(as_floats(single.worker.blocks.read(single_ids)), as_floats(computed_here), atol=1e-5)
    computed_there = group.worker.blocks.read(group_ids)
    group.worker.blocks.write(group_ids, computed_here, source_size=1)
    assert torch.allclose(as_floats(group.worker.blocks.read(group_ids)), as_floats(computed_there), atol=1e-5)
