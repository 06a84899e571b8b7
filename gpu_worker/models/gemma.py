"""Gemma 2 and Gemma 3 (text): (1 + w) RMSNorms around both the attention and the MLP, a GeGLU MLP, embeddings
scaled by sqrt(hidden_size), local (sliding-window) and global layers alternating, softcapped attention scores
and logits (Gemma 2), per-head q/k norms and a rotary base per kind of layer (Gemma 3). Elementwise work in
torch ops, as transformers computes it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.loading.weights import fused_checkpoint_tensor
from gpu_worker.model import AttentionBatch, ModelShape, RMSNorm, rope_cos_sin, rope_parameters, softcap
from gpu_worker.models.llama import LLAMA_FUSED, Attention, norm_heads

GLOBAL, LOCAL = "full_attention", "sliding_attention"


@dataclass
class GemmaShape(ModelShape):
    query_pre_attn_scalar: float = 0.0
    attn_softcap: float = 0.0    # 0: none
    final_softcap: float = 0.0


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the scale is (1 + weight), and the product is taken in float32 before rounding."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    all_reduce = None   # set on a tensor-parallel rank (gpu_worker/parallel/sharding.py)

    def __init__(self, shape: GemmaShape, window: int):
        super().__init__()
        size, eps = shape.hidden_size, shape.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = Attention(shape)
        self.self_attn.scale = shape.query_pre_attn_scalar ** -0.5
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = GemmaMLP(size, shape.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(size, eps)
        self.window = window
        self.attn_softcap = shape.attn_softcap

    def forward(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, batch: AttentionBatch,
                ops) -> torch.Tensor:
        """The residual stream in, the residual stream out (a new tensor)."""
        attn, (k_cache, v_cache) = self.self_attn, kv
        qkv = attn.qkv_proj(norm(self.input_layernorm, residual))
        if hasattr(attn, "q_norm"):
            qkv = norm_heads(qkv, attn.q_norm, attn.k_norm, attn.num_heads, attn.num_kv_heads, gemma_rms_norm)
        q = ops.rotary_store_kv(qkv, cos, sin, k_cache, v_cache, batch.slot_mapping, attn.num_heads,
                                attn.num_kv_heads)
        out = batch.attend(q, k_cache, v_cache, attn.scale, self.window, self.attn_softcap)
        attended = self.reduced(attn.o_proj(out.reshape(-1, attn.q_size)))
        residual = residual + norm(self.post_attention_layernorm, attended)
        mlp = self.reduced(self.mlp(norm(self.pre_feedforward_layernorm, residual)))
        return residual + norm(self.post_feedforward_layernorm, mlp)

    def reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(partial) if self.all_reduce is not None else partial


def norm(layer_norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return gemma_rms_norm(x, layer_norm.weight, layer_norm.eps)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 and Gemma 3 text, with the interface of every family (gpu_worker/models/__init__.py)."""

    def __init__(self, shape: GemmaShape):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(shape, window) for window in shape.layer_windows)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.attention_windows = tuple(sorted({w for w in shape.layer_windows if w}))
        self.attention_softcap = shape.attn_softcap
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # per kind of layer, set by load_rope
        self.layer_ops = None

    @classmethod
    def shape_from_config(cls, config) -> GemmaShape:
        if getattr(config, "attention_bias", False):
            raise ValueError("Gemma with attention biases is not supported")
        return GemmaShape.from_hf_config(
            config, qk_norm=config.model_type == "gemma3_text",
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
            attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0))

    def checkpoint_tensor(self, checkpoint: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        return fused_checkpoint_tensor(checkpoint, name, LLAMA_FUSED)

    def adapter_linears(self) -> list[dict[str, nn.Module]]:
        """Each layer's linears a LoRA adapter may target, by the names gpu_worker/lora/ gives them."""
        return [{"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                 "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj} for layer in self.layers]

    def load_rope(self, config, max_positions: int, device: torch.device) -> None:
        per_kind = GLOBAL in rope_parameters(config)   # Gemma 3: a rotary base (and scaling) per kind of layer
        for kind in (GLOBAL, LOCAL):
            cos, sin = rope_cos_sin(config, self.shape.head_dim, max_positions, kind if per_kind else None)
            self.rope[kind] = cos.to(device), sin.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        residual = embedded * torch.tensor(self.shape.hidden_size ** 0.5, dtype=embedded.dtype)
        rope = {kind: (cos[positions].to(residual.dtype), sin[positions].to(residual.dtype))
                for kind, (cos, sin) in self.rope.items()}
        for layer, kv in zip(self.layers, kv_caches):
            residual = layer(residual, *rope[LOCAL if layer.window else GLOBAL], kv, batch, self.layer_ops)
        return norm(self.norm, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return softcap(logits, self.shape.final_softcap) if self.shape.final_softcap else logits
