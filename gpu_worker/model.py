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
        """qkv [T, (H + 2 KV) * D] → rotated q [T, H, D]; rotated k and v stored at slots (-1: skipped)."""
        head_dim = cos.shape[-1]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = apply_rotary(q.view(-1, num_heads, head_dim), cos.unsqueeze(1), sin.unsqueeze(1))
        k = apply_rotary(k.view(-1, num_kv_heads, head_dim), cos.unsqueeze(1), sin.unsqueeze(1))
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


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.attention_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)
        self.scale = shape.head_dim ** -0.5


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's parts, looked up once: the forward runs 30-odd layers a step, and going through
    nn.Module calls and attribute lookups for each part cost ~4% of a decode step at batch 64 on CPU."""
    qkv_proj: object        # the linear layers' forward methods
    o_proj: object
    gate_up_proj: object
    down_proj: object
    post_attention_norm: RMSNorm
    next_norm: RMSNorm      # the next layer's input norm, or the final norm after the last layer
    num_heads: int
    num_kv_heads: int
    q_size: int
    scale: float

    @classmethod
    def of(cls, layer: DecoderLayer, next_norm: RMSNorm) -> LayerPlan:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(attn.qkv_proj.forward, attn.o_proj.forward, mlp.gate_up_proj.forward, mlp.down_proj.forward,
                   layer.post_attention_layernorm, next_norm, attn.num_heads, attn.num_kv_heads, attn.q_size,
                   attn.scale)

    def forward(self, hidden, residual, cos, sin, kv, batch, ops) -> torch.Tensor:
        """hidden: this layer's normalised input; residual: the residual stream, updated in place. Returns the
        next layer's normalised input (next_norm applied), as vLLM fuses it: each add goes with the next norm."""
        k_cache, v_cache = kv
        q = ops.rotary_store_kv(self.qkv_proj(hidden), cos, sin, k_cache, v_cache, batch.slot_mapping,
                                self.num_heads, self.num_kv_heads)
        attn = self.o_proj(batch.attend(q, k_cache, v_cache, self.scale).reshape(-1, self.q_size))
        norm = self.post_attention_norm
        hidden = ops.add_rms_norm(attn, residual, norm.weight, norm.eps)
        mlp = self.down_proj(ops.silu_mul(self.gate_up_proj(hidden)))
        return ops.add_rms_norm(mlp, residual, self.next_norm.weight, self.next_norm.eps)


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
        self.layer_ops = None                  # TorchLayerOps or kernels.cpu_layers.CpuLayerOps, set by the loader
        self.layer_plans: list[LayerPlan] | None = None   # built by the first forward, once the linears are final

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: "AttentionBatch") -> torch.Tensor:
        ops = self.layer_ops
        residual = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(residual.dtype)  # cast after lookup, as transformers does
        sin = self.rope_sin[positions].to(residual.dtype)
        first_norm = self.layers[0].input_layernorm
        hidden = ops.rms_norm(residual, first_norm.weight, first_norm.eps)
        if self.layer_plans is None:
            self.layer_plans = self.plan_layers()
        for plan, kv in zip(self.layer_plans, kv_caches):
            hidden = plan.forward(hidden, residual, cos, sin, kv, batch, ops)
        return hidden

    def plan_layers(self) -> list[LayerPlan]:
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        return [LayerPlan.of(layer, next_norm) for layer, next_norm in zip(self.layers, next_norms)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler widens them only where it needs to)."""
        return self.lm_head(hidden)


@dataclass
class AttentionBatch:
    """What every layer's attention needs for one step, built once per step by the model runner: groups of
    sequences (decodes of similar context length, then prefill chunks), each a contiguous run of token rows."""
    backend: ModuleType
    slot_mapping: torch.Tensor
    groups: list[tuple[slice, object]]   # (token rows, backend metadata)

    def attend(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """q [T, H, D]; every token's K and V are already in the pool."""
        if len(self.groups) == 1:
            return self.backend.attend(q, k_cache, v_cache, self.groups[0][1], scale)
        return torch.cat([self.backend.attend(q[rows], k_cache, v_cache, meta, scale) for rows, meta in self.groups])
