"""What transformers' GGUF config reader leaves out, read back from the file as llama.cpp reads it: without these,
the config class's defaults (one checkpoint's values) would silently replace what the file states."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader

GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}   # llama.cpp scales 27B's queries by hidden / heads, not head_dim


@dataclass
class GgufFile:
    """A file's architecture, metadata and float tensors by name, read once with gguf's reader."""
    reader: GGUFReader
    arch: str

    @classmethod
    def open(cls, path) -> GgufFile:
        reader = GGUFReader(path)
        return cls(reader, reader.fields["general.architecture"].contents())

    def value(self, key: str, default=None):
        """The architecture's metadata value `{arch}.{key}`."""
        field = self.reader.fields.get(f"{self.arch}.{key}")
        return default if field is None else field.contents()

    def tensor(self, name: str) -> np.ndarray | None:
        return next((np.array(t.data) for t in self.reader.tensors if t.name == name), None)


def complete_config(config, gguf_file: GgufFile) -> None:
    """Set on transformers' config of the file what its GGUF reader leaves at the class defaults."""
    key_length = gguf_file.value("attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):   # left out for Qwen3, among others
        config.head_dim = int(key_length)
    if gguf_file.arch == "qwen3moe":
        config.moe_intermediate_size = int(gguf_file.value("expert_feed_forward_length"))
    if gguf_file.arch in GEMMA_27B_LAYERS:
        set_gemma_attention(config, gguf_file)
    if gguf_file.arch == "gemma3":
        set_gemma3_global_rope(config, gguf_file)
    if gguf_file.arch == "phi3":   # Phi-3 mini 4k's window (2047) applies on every layer, in llama.cpp too
        config.sliding_window = gguf_file.value("attention.sliding_window", config.sliding_window)
    set_partial_rotary(config, gguf_file)
    if gguf_file.arch == "phi3" and gguf_file.tensor("rope_factors_long.weight") is not None:
        set_phi3_longrope(config, gguf_file)
    if (frequency_factors := gguf_file.tensor("rope_freqs.weight")) is not None:
        set_rope_frequency_factors(config, frequency_factors)


def set_gemma_attention(config, gguf_file: GgufFile) -> None:
    """The query scale llama.cpp uses, and Gemma 2's softcaps (llama.cpp's defaults are transformers' too)."""
    is_27b = config.num_hidden_layers == GEMMA_27B_LAYERS[gguf_file.arch]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if is_27b else config.head_dim
    if gguf_file.arch == "gemma2":
        config.attn_logit_softcapping = gguf_file.value("attn_logit_softcapping", config.attn_logit_softcapping)
        config.final_logit_softcapping = gguf_file.value("final_logit_softcapping", config.final_logit_softcapping)


def set_gemma3_global_rope(config, gguf_file: GgufFile) -> None:
    """The global layers' rope: the file's base and linear scaling (the local layers' base is fixed at 10,000)."""
    full = {"rope_type": "default", "rope_theta": float(gguf_file.value("rope.freq_base", 1_000_000.0))}
    if gguf_file.value("rope.scaling.type") == "linear":
        full |= {"rope_type": "linear", "factor": float(gguf_file.value("rope.scaling.factor"))}
    config.rope_parameters = dict(config.rope_parameters) | {"full_attention": full}


def set_partial_rotary(config, gguf_file: GgufFile) -> None:
    """Phi-4-mini's kind: llama.cpp's rope.dimension_count, fewer dims than the head's, is transformers'
    partial_rotary_factor."""
    rotary_dims = gguf_file.value("rope.dimension_count")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rotary_dims is None or int(rotary_dims) >= head_dim:
        return
    config.partial_rotary_factor = int(rotary_dims) / head_dim
    config.rope_parameters = dict(config.rope_parameters) | {"partial_rotary_factor": config.partial_rotary_factor}


def set_phi3_longrope(config, gguf_file: GgufFile) -> None:
    """Phi-3's LongRoPE: its factors are tensors of the file, its original context a metadata value."""
    original = int(gguf_file.value("rope.scaling.original_context_length"))
    config.original_max_position_embeddings = original
    config.rope_parameters = dict(config.rope_parameters) | {
        "rope_type": "longrope", "original_max_position_embeddings": original,
        "short_factor": gguf_file.tensor("rope_factors_short.weight").tolist(),
        "long_factor": gguf_file.tensor("rope_factors_long.weight").tolist()}


def set_rope_frequency_factors(config, factors: np.ndarray) -> None:
    """Llama 3's rope scaling, which llama.cpp's converter stores only as a divisor of each frequency
    (`rope_freqs`): LongRoPE with those factors at every position (no long context, no attention factor) is the
    same rotation."""
    config.rope_parameters = {
        "rope_type": "longrope", "rope_theta": config.rope_parameters["rope_theta"],
        "short_factor": factors.tolist(), "long_factor": factors.tolist(),
        "original_max_position_embeddings": config.max_position_embeddings}
