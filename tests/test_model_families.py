"""Every supported model family is token-exact against transformers `generate`: a tiny random model of each,
saved by transformers in float32, 4 prompts batched with greedy decoding, a prefix-cache hit and preemption."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, MistralConfig,
                          MixtralConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig)

from ferry import Engine, EngineConfig, SamplingParams
from gpu_worker.model import rope_cos_sin
from gpu_worker.models import model_class
from tests.conftest import build_tiny_tokenizer, transformers_greedy

BLOCK_SIZE = 4
MAX_TOKENS = 12
WINDOW = 6   # sliding windows shorter than the prompts, not a multiple of the block size
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
HEAD_DIM = 16

FAMILIES = {
    "mistral_windowed": lambda: MistralConfig(head_dim=HEAD_DIM, **COMMON, sliding_window=WINDOW),  # all local
    "qwen3": lambda: Qwen3Config(head_dim=HEAD_DIM, **COMMON),
    "phi3": lambda: Phi3Config(**COMMON, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 0.7 * i for i in range(HEAD_DIM // 2)]}),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(head_dim=HEAD_DIM, **COMMON | dict(num_hidden_layers=3), num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
    "gemma2": lambda: Gemma2Config(head_dim=HEAD_DIM, **COMMON | dict(tie_word_embeddings=True),
                                   sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=3.0),
    "gemma3_text": lambda: Gemma3TextConfig(
        head_dim=HEAD_DIM, **COMMON | dict(num_hidden_layers=3, tie_word_embeddings=True), sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=16,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def build_tiny_model(path, model_type: str):
    tokenizer = build_tiny_tokenizer(path)
    config = FAMILIES[model_type]()
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so greedy outputs vary with the prompt
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            else:          # norms off their identity, so that a (1 + w) norm read as w shows
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path, model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path, model = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """A shared 8-token prefix (two blocks, cached after the first prompt) and suffixes of 1 to 20 tokens."""
    prefix = [17, 230, 41, 99, 5, 311, 64, 150]
    return [prefix + [(37 * i + 11 * n) % 400 + 3 for i in range(n)] for n in (1, 7, 13, 20)]


def tiny_engine(model_dir, **overrides) -> Engine:
    config = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                  kv_cache_memory=1 << 22, max_model_len=64)
    return Engine(EngineConfig(**config | overrides))


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


def write_qwen3_gguf(model, model_dir, path) -> None:
    """The model's float32 tensors under llama.cpp's names and its config and BPE tokenizer as GGUF metadata, as
    gguf.GGUFWriter writes them (what llama.cpp's converter would produce, unquantized)."""
    import gguf
    import numpy as np

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name("tiny-qwen3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])   # 3: control tokens
    writer.add_token_merges([" ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen3_gguf_file_is_served_token_exact_against_transformers(tmp_path, prompts, monkeypatch):
    """A GGUF file as --model: dequantized once into the cache (its head size read from the file, which
    transformers' GGUF config leaves out), then served like the HF directory it was written from."""
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, model = build_tiny_model(tmp_path / "hf", "qwen3")
    write_qwen3_gguf(model, model_dir, tmp_path / "tiny-qwen3.gguf")
    engine = tiny_engine(tmp_path / "tiny-qwen3.gguf")
    assert engine.info.model_path.startswith(str(tmp_path / "cache"))
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == transformers_greedy(model, prompts, MAX_TOKENS)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert engine.encode("hello world") == hf_tokenizer("hello world", add_special_tokens=False).input_ids


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
