"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) in Ferry's own layers, attending over the paged KV pool.
Qwen3, Phi-3 and the mixtures of experts are this model with a part changed (gpu_worker/models/)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from gpu_worker.loading.weights import fused_checkpoint_tensor
from gpu_worker.model import AttentionBatch, ModelShape, RMSNorm, rope_cos_sin

LLAMA_FUSED = {  # Ferry parameter suffix -> the checkpoint's parts, concatenated along dim 0
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.attention_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)
        self.scale = shape.head_dim ** -0.5
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = mlp


def norm_heads(qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int,
               rms_norm) -> torch.Tensor:
    """An RMSNorm over each head of q and k (v untouched), before the rotary (Qwen3, Gemma 3): a new qkv
    [T, (H + 2 KV) * D]. rms_norm(x, weight, eps) is the model's kind of norm."""
    head_dim = q_norm.weight.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rms_norm(q.reshape(-1, head_dim), q_norm.weight, q_norm.eps).view(qkv.shape[0], -1)
    k = rms_norm(k.reshape(-1, head_dim), k_norm.weight, k_norm.eps).view(qkv.shape[0], -1)
    return torch.cat([q, k, v], dim=-1)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's parts, looked up once: the forward runs 30-odd layers a step, and going through
    nn.Module calls and attribute lookups for each part cost ~4% of a decode step at batch 64 on CPU."""
    qkv_proj: object        # the linear layers' forward methods
    o_proj: object
    gate_up_proj: object | None   # None: the MLP is a module of its own (a mixture of experts)
    down_proj: object | None
    mlp: nn.Module
    qk_norm: tuple[RMSNorm, RMSNorm] | None
    post_attention_norm: RMSNorm
    next_norm: RMSNorm      # the next layer's input norm, or the final norm after the last layer
    num_heads: int
    num_kv_heads: int
    q_size: int
    scale: float
    window: int             # sliding window, 0: global
    all_reduce: object | None = None   # under tensor parallelism: the sum of the ranks' partial o and down outputs

    @classmethod
    def of(cls, layer: DecoderLayer, next_norm: RMSNorm, window: int, all_reduce=None) -> LayerPlan:
        attn, mlp = layer.self_attn, layer.mlp
        dense = isinstance(mlp, MLP)
        qk_norm = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        return cls(attn.qkv_proj.forward, attn.o_proj.forward, mlp.gate_up_proj.forward if dense else None,
                   mlp.down_proj.forward if dense else None, mlp, qk_norm, layer.post_attention_layernorm,
                   next_norm, attn.num_heads, attn.num_kv_heads, attn.q_size, attn.scale, window, all_reduce)

    def forward(self, hidden, residual, cos, sin, kv, batch, ops) -> torch.Tensor:
        """hidden: this layer's normalised input; residual: the residual stream, updated in place. Returns the
        next layer's normalised input (next_norm applied), as vLLM fuses it: each add goes with the next norm."""
        k_cache, v_cache = kv
        qkv = self.qkv_proj(hidden)
        if self.qk_norm is not None:
            qkv = norm_heads(qkv, *self.qk_norm, self.num_heads, self.num_kv_heads, ops.rms_norm)
        q = ops.rotary_store_kv(qkv, cos, sin, k_cache, v_cache, batch.slot_mapping, self.num_heads,
                                self.num_kv_heads)
        attn = self.o_proj(batch.attend(q, k_cache, v_cache, self.scale, self.window).reshape(-1, self.q_size))
        if self.all_reduce is not None:
            attn = self.all_reduce(attn)
        norm = self.post_attention_norm
        hidden = ops.add_rms_norm(attn, residual, norm.weight, norm.eps)
        if self.gate_up_proj is not None:
            mlp = self.down_proj(ops.silu_mul(self.gate_up_proj(hidden)))
        else:
            mlp = self.mlp(hidden, ops)
        if self.all_reduce is not None:
            mlp = self.all_reduce(mlp)
        return ops.add_rms_norm(mlp, residual, self.next_norm.weight, self.next_norm.eps)


class LlamaForCausalLM(nn.Module):
    """The model interface every family keeps (gpu_worker/models/__init__.py)."""
    fused_weights = LLAMA_FUSED
    all_reduce = None   # set on a tensor-parallel rank (gpu_worker/parallel/sharding.py)

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.windows = shape.layer_windows or (0,) * shape.num_layers
        self.attention_windows = tuple(sorted({w for w in self.windows if w}))
        self.attention_softcap = 0.0
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, self.make_mlp(shape, i)) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_cos = self.rope_sin = None   # float32 tables [max_positions, head_dim], set by load_rope
        self.layer_ops = None                  # TorchLayerOps or kernels.cpu_layers.CpuLayerOps, set by the loader
        self.layer_plans: list[LayerPlan] | None = None   # built by the first forward, once the linears are final

    @classmethod
    def shape_from_config(cls, config) -> ModelShape:
        return ModelShape.from_hf_config(config, attention_bias=bool(getattr(config, "attention_bias", False))
                                         or config.model_type == "qwen2")

    def make_mlp(self, shape: ModelShape, layer_index: int) -> nn.Module:
        return MLP(shape.hidden_size, shape.intermediate_size)

    def checkpoint_tensor(self, checkpoint: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        return fused_checkpoint_tensor(checkpoint, name, self.fused_weights)

    def load_rope(self, config, max_positions: int, device: torch.device) -> None:
        cos, sin = rope_cos_sin(config, self.shape.head_dim, max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch) -> torch.Tensor:
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
        return [LayerPlan.of(layer, next_norm, window, self.all_reduce)
                for layer, next_norm, window in zip(self.layers, next_norms, self.windows)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler widens them only where it needs to)."""
        return self.lm_head(hidden)
