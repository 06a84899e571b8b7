"""GGUF files of every family the `gguf` package reads, written as llama.cpp's converter writes them (its
architecture, tensor names, layouts and metadata; tensors in float32 or Q8_0) from a tiny random transformers model,
given to Ferry as --model and served token-exact against transformers on the model they were written from."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Callable
from unittest.mock import patch

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          Qwen3MoeConfig)

from tests.conftest import transformers_greedy
from tests.model_families_fixtures import (COMMON, FAMILIES, GREEDY, HEAD_DIM, MAX_TOKENS, WINDOW, build_tiny_model,
                                           prompts, tiny_engine)

__all__ = ["prompts"]   # the shared fixture

Q8_0 = gguf.GGMLQuantizationType.Q8_0
def with_sliding_window(config):
    config.sliding_window = WINDOW
    return config


SOURCES = {  # what llama.cpp can express: every Qwen3-MoE layer sparse, Gemma 3's local:global pattern 5:1
    "llama": lambda: LlamaConfig(head_dim=HEAD_DIM, **COMMON),
    "llama3": lambda: LlamaConfig(head_dim=HEAD_DIM, **COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),   # of its 8 frequencies: 1 kept, 2 smoothed, 5 scaled
    "mistral": lambda: MistralConfig(head_dim=HEAD_DIM, **COMMON, sliding_window=None),
    "mixtral": FAMILIES["mixtral"],
    "mixtral_per_expert": FAMILIES["mixtral"],
    "qwen3_moe": lambda: Qwen3MoeConfig(head_dim=HEAD_DIM, **COMMON, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, norm_topk_prob=True),
    "qwen3": FAMILIES["qwen3"],
    "phi3": FAMILIES["phi3"],
    "phi3_windowed": lambda: with_sliding_window(FAMILIES["phi3"]()),   # Phi-3 mini 4k's window is 2047
    "phi3_partial_rotary": FAMILIES["phi3_partial_rotary"],
    "gemma2": FAMILIES["gemma2"],
    "gemma3_text": lambda: Gemma3TextConfig(
        head_dim=HEAD_DIM, **COMMON | dict(num_hidden_layers=6, tie_word_embeddings=True), sliding_window=WINDOW,
        query_pre_attn_scalar=HEAD_DIM,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@dataclass
class Layout:
    """How llama.cpp's converter writes a family: its architecture, the metadata beyond the common keys, and what it
    does to tensor values (q/k rows permuted for llama's rotation, Gemma's norms stored as 1 + w)."""
    arch: gguf.MODEL_ARCH
    metadata: Callable = lambda writer, config: None
    permute_qk: bool = False
    norms_plus_one: bool = False
    extra_tensors: Callable = lambda config: {}
    name: str = "tiny"
    stacked_experts: bool = True   # False: one tensor per expert, as llama.cpp wrote Mixtral before April 2024


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim(config))
    if getattr(config, "num_local_experts", 0):
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)


def qwen3moe_metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def phi3_metadata(writer: gguf.GGUFWriter, config) -> None:
    rope = config.rope_parameters
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    writer.add_rope_dimension_count(int(head_dim(config) * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
        rope["original_max_position_embeddings"])))


def phi3_rope_factors(config) -> dict[str, np.ndarray]:
    rope = config.rope_parameters
    return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}


def llama3_rope_freqs(config) -> dict[str, np.ndarray]:
    """Llama 3's rope scaling as llama.cpp's converter stores it: each frequency's divisor."""
    rope = config.rope_parameters
    dim, original = head_dim(config), rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1)
        elif wavelen > original / low:
            factors.append(rope["factor"])
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return {"rope_freqs.weight": np.array(factors, dtype=np.float32)}


def gemma2_metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_sliding_window(config.sliding_window)
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)


def gemma3_metadata(writer: gguf.GGUFWriter, config) -> None:
    full = config.rope_parameters["full_attention"]
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(full["factor"])


LAYOUTS = {
    "llama": Layout(gguf.MODEL_ARCH.LLAMA, llama_metadata, permute_qk=True),
    "llama3": Layout(gguf.MODEL_ARCH.LLAMA, llama_metadata, permute_qk=True, extra_tensors=llama3_rope_freqs),
    "mistral": Layout(gguf.MODEL_ARCH.LLAMA, llama_metadata, permute_qk=True, name="Mistral 7B Instruct v0.3"),
    "mixtral": Layout(gguf.MODEL_ARCH.LLAMA, llama_metadata, permute_qk=True),
    "mixtral_per_expert": Layout(gguf.MODEL_ARCH.LLAMA, llama_metadata, permute_qk=True, stacked_experts=False),
    "qwen3": Layout(gguf.MODEL_ARCH.QWEN3, lambda writer, config: writer.add_vocab_size(config.vocab_size),
                    name="tiny-qwen3"),
    "qwen3_moe": Layout(gguf.MODEL_ARCH.QWEN3MOE, qwen3moe_metadata),
    "phi3": Layout(gguf.MODEL_ARCH.PHI3, phi3_metadata, extra_tensors=phi3_rope_factors),
    "phi3_windowed": Layout(gguf.MODEL_ARCH.PHI3, phi3_metadata, extra_tensors=phi3_rope_factors),
    "phi3_partial_rotary": Layout(gguf.MODEL_ARCH.PHI3, phi3_metadata, extra_tensors=phi3_rope_factors),
    "gemma2": Layout(gguf.MODEL_ARCH.GEMMA2, gemma2_metadata, norms_plus_one=True),
    "gemma3_text": Layout(gguf.MODEL_ARCH.GEMMA3, gemma3_metadata, norms_plus_one=True),
}


def permute_for_llama_cpp(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two rotary halves (LlamaModel.permute)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def stack_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors `...experts.{e}.{w}.weight` stacked into one [experts, out, in] `...experts.{w}.weight`,
    as llama.cpp's converter merges them."""
    stacked, experts = {}, {}
    for name, tensor in state.items():
        if match := re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = tensor
        else:
            stacked[name] = tensor
    for name, parts in experts.items():
        stacked[name] = np.stack([parts[e] for e in sorted(parts)])
    return stacked


def gguf_name(names: gguf.TensorNameMap, name: str) -> str:
    if match := re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w\d)\.weight", name):
        part = {"w1": "gate", "w2": "down", "w3": "up"}[match[3]]
        return f"blk.{match[1]}.ffn_{part}.{match[2]}.weight"
    return names.get_name(name, try_suffixes=(".weight", ".bias"))


def gguf_tensors(model_dir, config, layout: Layout) -> dict[str, np.ndarray]:
    """The checkpoint transformers saved, under llama.cpp's names and in its layouts."""
    state = {name: t.numpy() for name, t in load_file(model_dir / "model.safetensors").items()}
    state = stack_experts(state) if layout.stacked_experts else state
    names = gguf.get_tensor_name_map(layout.arch, config.num_hidden_layers)
    tensors = {}
    for name, tensor in state.items():
        if layout.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = permute_for_llama_cpp(tensor, heads)
        if layout.norms_plus_one and name.endswith("norm.weight"):
            tensor = tensor + 1
        tensors[gguf_name(names, name)] = tensor.astype(np.float32)
    return tensors | layout.extra_tensors(config)


def write_common_metadata(writer: gguf.GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    if "rope_theta" in config.rope_parameters:   # Gemma 3's are per layer type
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def write_tokenizer(writer: gguf.GGUFWriter, model_dir, config) -> None:
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


def add_tensor(writer: gguf.GGUFWriter, name: str, tensor: np.ndarray, quantize: bool) -> None:
    if quantize and tensor.ndim >= 2:
        writer.add_tensor(name, gguf.quants.quantize(tensor, Q8_0), raw_dtype=Q8_0)
    else:
        writer.add_tensor(name, tensor)


def write_gguf(model, model_dir, path, family: str, quantize: bool = False) -> None:
    config, layout = model.config, LAYOUTS[family]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[layout.arch])
    writer.add_name(layout.name)
    write_common_metadata(writer, config)
    layout.metadata(writer, config)
    write_tokenizer(writer, model_dir, config)
    for name, tensor in gguf_tensors(model_dir, config, layout).items():
        add_tensor(writer, name, tensor, quantize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_source_model(path, family: str):
    with patch.dict(FAMILIES, {family: SOURCES[family]}):
        return build_tiny_model(path, family)


def served_from_gguf(tmp_path, monkeypatch, family: str, quantize: bool = False):
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, model = build_source_model(tmp_path / "hf", family)
    write_gguf(model, model_dir, tmp_path / f"tiny-{family}.gguf", family, quantize)
    engine = tiny_engine(tmp_path / f"tiny-{family}.gguf")
    assert engine.info.model_path.startswith(str(tmp_path / "cache"))
    return engine, model


@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen3_moe", "phi3", "phi3_windowed",
                                    "phi3_partial_rotary", "gemma2", "gemma3_text", "mixtral", "mixtral_per_expert"])
def test_a_gguf_file_of_each_family_is_served_token_exact_against_transformers(tmp_path, monkeypatch, prompts,
                                                                               family):
    engine, model = served_from_gguf(tmp_path, monkeypatch, family)
    expected = transformers_greedy(model, prompts, MAX_TOKENS)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected


def test_a_qwen3_gguf_file_is_served_token_exact_against_transformers(tmp_path, prompts, monkeypatch):
    """A GGUF file as --model: dequantized once into the cache (its head size read from the file, which
    transformers' GGUF config leaves out), then served like the HF directory it was written from."""
    engine, model = served_from_gguf(tmp_path, monkeypatch, "qwen3")
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == transformers_greedy(model, prompts, MAX_TOKENS)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert engine.encode("hello world") == hf_tokenizer("hello world", add_special_tokens=False).input_ids


def q8_0_round_trip(model) -> torch.nn.Module:
    """The model with every matrix quantized to Q8_0 and back by gguf's own code, as a Q8_0 file holds it."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                data = parameter.numpy()
                parameter.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, Q8_0), Q8_0)
                                                 .reshape(data.shape)))
    return model


def test_a_q8_0_mixtral_gguf_is_served_as_transformers_serves_its_dequantized_weights(tmp_path, monkeypatch, prompts):
    engine, model = served_from_gguf(tmp_path, monkeypatch, "mixtral", quantize=True)
    reference = q8_0_round_trip(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval())
    expected = transformers_greedy(reference, prompts, MAX_TOKENS)
    assert expected != transformers_greedy(model, prompts, MAX_TOKENS)   # the quantization shows in the output
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
