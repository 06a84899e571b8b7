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



def build_gemma3_image_text_model(path):
    """A tiny Gemma 3 image-text checkpoint (`gemma3`: a SigLIP vision tower, a projector and the language model),
    saved by transformers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from tests.conftest import build_tiny_tokenizer
    from tests.model_families_fixtures import COMMON
    tokenizer = build_tiny_tokenizer(path)
    text = Gemma3TextConfig(head_dim=HEAD_DIM, **COMMON | dict(num_hidden_layers=3, tie_word_embeddings=True),
                            sliding_window=WINDOW, query_pre_attn_scalar=16, vocab_size=len(tokenizer),
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=len(tokenizer) - 1, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():   # weights larger than the default init, so that greedy outputs vary with the prompt
        for name, param in model.named_parameters():
            if "language_model" in name and param.dim() >= 2:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("names", ["language_model.model.", "model.language_model."])
def test_the_language_model_of_a_gemma3_image_text_checkpoint_is_served_as_transformers(tmp_path, prompts, names):
    """Text in, text out: the checkpoint's language model, its tensors under either prefix (as Gemma 3 was
    published, as transformers 5 names them in memory), the vision tower's left unread."""
    from safetensors.torch import load_file, save_file
    model = build_gemma3_image_text_model(tmp_path)
    if names == "model.language_model.":
        weights = load_file(tmp_path / "model.safetensors")
        save_file({name.replace("language_model.model.", names): t for name, t in weights.items()},
                  tmp_path / "model.safetensors", metadata={"format": "pt"})
    expected = transformers_greedy(model, prompts, MAX_TOKENS)
    assert [r.token_ids for r in tiny_engine(tmp_path).generate(prompts, GREEDY)] == expected


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
