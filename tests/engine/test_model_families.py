"""Every supported model family is token-exact against transformers `generate`: a tiny random model of each,
saved by transformers in float32, 4 prompts batched with greedy decoding, a prefix-cache hit and preemption."""
from __future__ import annotations

import pytest
import torch

from ferry import Engine
from gpu_worker.model import rope_cos_sin
from gpu_worker.models import model_class
from tests.conftest import transformers_greedy
from tests.model_families_fixtures import (BLOCK_SIZE, FAMILIES, GREEDY, HEAD_DIM, MAX_TOKENS, WINDOW,
                                           build_tiny_model, prompts, tiny_engine)

__all__ = ["prompts"]   # the shared fixture


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path, model = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, model


def kv_bytes(engine: Engine, num_blocks: int) -> int:
    return num_blocks * engine.worker.runner.pool.tensor[:, :, :1].numel() * 4


def test_batched_greedy_generation_with_a_prefix_cache_hit_matches_transformers(family, prompts):
    _, model_dir, model = family
    expected = transformers_greedy(model, prompts, MAX_TOKENS)
    engine = tiny_engine(model_dir)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    hits = engine.stats().prefix_cache_hits
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected   # the whole prompts cached now
    assert engine.stats().prefix_cache_hits > hits


def test_preempted_requests_finish_with_the_tokens_of_transformers(family, prompts):
    _, model_dir, model = family
    expected = transformers_greedy(model, prompts, MAX_TOKENS)
    probe = tiny_engine(model_dir)
    num_blocks = 12 if probe.info.sliding_window else 14   # blocks before the window freed: a pool that runs dry
    engine = tiny_engine(model_dir, kv_cache_memory=kv_bytes(probe, num_blocks))
    assert engine.info.num_blocks == num_blocks
    results = engine.generate(prompts, GREEDY)
    assert engine.stats().num_preemptions > 0
    assert [r.token_ids for r in results] == expected


def test_a_sequence_past_the_window_of_every_layer_holds_only_the_blocks_in_it(tmp_path, prompts):
    """Mistral with a sliding window on every layer: blocks wholly before the window go back to the pool as the
    sequences decode, and the outputs stay transformers' (the worker never reads a block given back)."""
    model_dir, model = build_tiny_model(tmp_path, "mistral_windowed")
    engine = tiny_engine(model_dir)
    assert engine.info.sliding_window == WINDOW
    manager = engine.scheduler.block_manager
    outputs = {str(i): [] for i in range(len(prompts))}
    for request_id, prompt in zip(outputs, prompts):
        engine.add_request(request_id, prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        decoding = [s for s in engine.scheduler.running if s.num_computed_tokens > s.num_prompt_tokens]
        assert all(manager.num_held_blocks(s) <= -(-WINDOW // BLOCK_SIZE) + 1 for s in decoding)
    assert max(len(p) for p in prompts) + MAX_TOKENS > 4 * WINDOW
    assert list(outputs.values()) == transformers_greedy(model, prompts, MAX_TOKENS)
    assert manager.num_free_blocks == manager.num_blocks


def test_a_windowed_request_longer_than_the_pool_is_taken_and_served_exactly(tmp_path, prompts):
    """Every layer local: a sequence only ever holds the blocks its window and one step reach, so a request whose
    prompt + max_tokens would not fit in the whole pool is still taken, and its output is transformers'."""
    model_dir, model = build_tiny_model(tmp_path, "mistral_windowed")
    engine = tiny_engine(model_dir, kv_cache_memory=kv_bytes(tiny_engine(model_dir), 6), max_num_batched_tokens=8)
    manager, prompt = engine.scheduler.block_manager, prompts[-1]
    assert manager.num_blocks == 6 and manager.blocks_for(len(prompt) + MAX_TOKENS) > 6
    engine.add_request("long", prompt, GREEDY)
    output = []
    while engine.has_unfinished_requests():
        output += [t for out in engine.step() for t in out.new_token_ids]
    assert [output] == transformers_greedy(model, [prompt], MAX_TOKENS)
    assert manager.num_free_blocks == manager.num_blocks



def test_longrope_tables_are_transformers_short_and_long_rotations():
    """Phi-3's LongRoPE: below original_max_position_embeddings the short factors, from there on the long ones, each
    with the attention factor, as transformers rotates a forward whose positions all lie on one side."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = FAMILIES["phi3"]()
    cos, sin = rope_cos_sin(config, HEAD_DIM, 128)
    for positions in (torch.arange(0, 64), torch.arange(64, 128)):
        expected_cos, expected_sin = Phi3RotaryEmbedding(config)(torch.zeros(1), positions.unsqueeze(0))
        torch.testing.assert_close(cos[positions], expected_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(sin[positions], expected_sin[0], rtol=0, atol=0)


def test_an_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="'gpt2' is not supported.*gemma2.*llama.*mixtral.*phi3.*qwen3"):
        model_class("gpt2")
