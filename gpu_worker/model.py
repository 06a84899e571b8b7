"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) in Ferry's own layers, attending over the paged KV pool."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
            attention_bias=getattr(config, "attention_bias", False) or config.model_type == "qwen2",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings)


def rope_cos_sin(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] for every rope type transformers knows."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.attention_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)
        self.scale = shape.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                batch: "AttentionBatch") -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = batch.attend(q, k, v, kv[0], kv[1], self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.intermediate_size = shape.intermediate_size
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x, cos, sin, kv, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_cos = self.rope_sin = None   # float32 tables [max_positions, head_dim], set by the loader

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                batch: "AttentionBatch") -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1).to(x.dtype)  # cast after lookup, as transformers does
        sin = self.rope_sin[positions].unsqueeze(1).to(x.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, batch)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


@dataclass
class AttentionBatch:
    """What every layer's attention needs for one step, built once per step by the model runner: groups of
    sequences (decodes of similar context length, then prefill chunks), each a contiguous run of token rows."""
    backend: ModuleType
    slot_mapping: torch.Tensor
    groups: list[tuple[slice, object]]   # (token rows, backend metadata)

    def attend(self, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
        self.backend.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if len(self.groups) == 1:
            return self.backend.attend(q, k_cache, v_cache, self.groups[0][1], scale)
        return torch.cat([self.backend.attend(q[rows], k_cache, v_cache, meta, scale) for rows, meta in self.groups])
