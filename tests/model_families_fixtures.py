"""What the model-family tests share: a tiny random transformers model of each family (float32, weights larger
than the default init), the prompts they decode, and an engine on the CPU over a model directory or GGUF file."""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig, MixtralConfig,
                          Phi3Config, Qwen3Config, Qwen3MoeConfig)

from ferry import Engine, EngineConfig, SamplingParams
from tests.conftest import build_tiny_tokenizer

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
    # Phi-4-mini's kind: only the first 3/4 of each head rotates (partial_rotary_factor), LongRoPE over those dims
    "phi3_partial_rotary": lambda: Phi3Config(**COMMON, partial_rotary_factor=0.75, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.75, "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM * 3 // 8)],
        "long_factor": [1.0 + 0.7 * i for i in range(HEAD_DIM * 3 // 8)]}, original_max_position_embeddings=64),
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


def build_tiny_model(path, model_type: str, **overrides):
    """overrides: config fields set after the family's (vocab_size included)."""
    tokenizer = build_tiny_tokenizer(path)
    config = FAMILIES[model_type]()
    config.vocab_size = len(tokenizer)
    for name, value in overrides.items():
        setattr(config, name, value)
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


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """A shared 8-token prefix (two blocks, cached after the first prompt) and suffixes of 1 to 20 tokens."""
    prefix = [17, 230, 41, 99, 5, 311, 64, 150]
    return [prefix + [(37 * i + 11 * n) % 400 + 3 for i in range(n)] for n in (1, 7, 13, 20)]


def tiny_engine(model_dir, **overrides) -> Engine:
    config = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                  kv_cache_memory=1 << 22, max_model_len=64)
    return Engine(EngineConfig(**config | overrides))
