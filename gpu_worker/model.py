"""Ferry's shared model layers: the shape read from a config, rotary tables, a layer's elementwise ops, and the
attention over the paged KV pool. The families themselves live in gpu_worker/models/ (one file each)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels import torch_paged


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
    qk_norm: bool = False      # an RMSNorm over each head of q and k before the rotary (Qwen3, Gemma 3)
    layer_windows: tuple[int, ...] = ()   # each layer's sliding window (0: global attention)

    @classmethod
    def from_hf_config(cls, config, **extra) -> ModelShape:
        """The fields every decoder-only config spells the same way; a family adds its own as keyword arguments."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        fields = dict(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings, layer_windows=layer_windows(config))
        return cls(**(fields | extra))


def layer_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it: to the layers layer_types calls sliding where the
    config has layer_types, to every layer where it has only sliding_window (Mistral, Phi-3, Mixtral)."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def rope_parameters(config, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get(layer_type, params) if layer_type else params


def rope_cos_sin(config, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, rotary dims] for every rope type transformers knows: the rotary dims are the
    head's first head_dim * partial_rotary_factor (all of it, but for Phi-4-mini's kind). layer_type picks the
    parameters of configs that have one set per kind of layer (Gemma 3)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "longrope":
        return longrope_cos_sin(config, max_positions)
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    elif layer_type:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return cos_sin_of(inv_freq, scaling, torch.arange(max_positions))


def cos_sin_of(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(positions.float(), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def longrope_cos_sin(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3's LongRoPE: the short factors below original_max_position_embeddings, the long ones from there on.
    transformers picks one set per forward call by the call's highest position: the same as this table for every
    decode step and for prompts shorter than the original context."""
    original = rope_parameters(config)["original_max_position_embeddings"]
    short_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=original + 1)
    positions = torch.arange(max_positions)
    short, long = cos_sin_of(short_freq, scaling, positions), cos_sin_of(long_freq, scaling, positions)
    is_long = (positions >= original).unsqueeze(1)
    return torch.where(is_long, long[0], short[0]), torch.where(is_long, long[1], short[1])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary on the first cos.shape[-1] dims of x's last one, the others kept (transformers' partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


class TorchLayerOps:
    """A layer's elementwise work in torch ops, as transformers computes it: the reference, and the path on
    CUDA. kernels.cpu_layers.CpuLayerOps fuses the same work on the CPU."""

    def __init__(self, store_kv):
        self.store_kv = store_kv   # the attention backend's

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place; returns RMSNorm(residual)."""
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def rotary_store_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """qkv [T, (H + 2 KV) * D] → rotated q [T, H, D]; rotated k and v stored at slots (-1: skipped). Only
        each head's first cos.shape[-1] dims rotate (partial rotary embeddings); the rest pass as they are."""
        head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = rotate_part(q.view(-1, num_heads, head_dim), cos.unsqueeze(1), sin.unsqueeze(1))
        k = rotate_part(k.view(-1, num_kv_heads, head_dim), cos.unsqueeze(1), sin.unsqueeze(1))
        self.store_kv(k, v.view(-1, num_kv_heads, head_dim), k_cache, v_cache, slots)
        return q

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), as Gemma caps its attention scores and logits."""
    return torch.tanh(x / cap) * cap


@dataclass
class AttentionBatch:
    """What every layer's attention needs for one step, built once per step by the model runner: groups of
    sequences (decodes of similar context length, then prefill chunks), each a contiguous run of token rows.
    window_groups: the same rows prepared per sliding window (0: none, for softcapped scores, which only
    kernels.torch_paged's masks apply), for the layers that need them (model_runner.ModelRunner.window_groups)."""
    backend: ModuleType
    slot_mapping: torch.Tensor
    groups: list[tuple[slice, object]]   # (token rows, backend metadata)
    window_groups: dict[int, list[tuple[slice, object]]] = field(default_factory=dict)

    def attend(self, q, k_cache, v_cache, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q [T, H, D]; every token's K and V are already in the pool. A window no context of this step reaches
        has no groups of its own: those layers attend as global ones."""
        if window not in self.window_groups:
            window = 0
        if softcap:
            return torch.cat([torch_paged.attend(q[rows], k_cache, v_cache, meta, scale, softcap)
                              for rows, meta in self.window_groups[window]])
        if window:
            return torch.cat([self.backend.attend(q[rows], k_cache, v_cache, meta, scale)
                              for rows, meta in self.window_groups[window]])
        if len(self.groups) == 1:
            return self.backend.attend(q, k_cache, v_cache, self.groups[0][1], scale)
        return torch.cat([self.backend.attend(q[rows], k_cache, v_cache, meta, scale) for rows, meta in self.groups])
