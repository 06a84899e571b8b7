"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k SiLU-gated experts, and the
tokens are grouped by expert so that every expert runs once, on all its tokens, per step."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import cpu_linear
from gpu_worker.model import ModelShape
from gpu_worker.models.llama import LlamaForCausalLM, MLP


@dataclass
class MoeShape(ModelShape):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    normalize_top_k: bool = True        # routing weights renormalised over the chosen experts
    round_routing_weights: bool = False  # routing weights rounded to the model's dtype before use (Qwen3-MoE)
    sparse_layers: tuple[bool, ...] = ()  # per layer: a mixture of experts (True) or a dense MLP


class SparseMoe(nn.Module):
    def __init__(self, shape: MoeShape):
        super().__init__()
        experts, hidden, inner = shape.num_experts, shape.hidden_size, shape.moe_intermediate_size
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, inner))
        self.num_experts = experts
        self.top_k = shape.num_experts_per_tok
        self.normalize_top_k = shape.normalize_top_k
        self.round_routing_weights = shape.round_routing_weights
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] = []   # on the CPU: oneDNN's layout

    def pack_experts(self) -> None:
        """Each expert's weights packed once, as cpu_linear packs the dense linears (plain F.linear on CPU is
        slower per call, and a step calls it twice per expert); the stacked tensors are dropped."""
        self.packed_experts = [(cpu_linear.pack_weight(gate_up), cpu_linear.pack_weight(down))
                               for gate_up, down in zip(self.experts_gate_up, self.experts_down)]
        self.experts_gate_up = self.experts_down = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (softmax over all experts, in float32)."""
        probs = torch.softmax(self.gate(hidden).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize_top_k:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.round_routing_weights:
            weights = weights.to(hidden.dtype)
        return weights, experts

    def forward(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        weights, experts = self.route(hidden)
        order = experts.flatten().argsort(stable=True)        # (token, slot) pairs grouped by expert
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()
        weights = weights.flatten()
        out = torch.zeros_like(hidden)
        start = 0
        for expert, count in enumerate(counts):   # experts in order: each token's outputs add up as transformers'
            if count:
                pairs = order[start:start + count]
                tokens = pairs // self.top_k
                expert_out = self.run_expert(expert, hidden[tokens], ops) * weights[pairs, None]
                out[tokens] += expert_out.to(out.dtype)   # a token picks an expert once; index_add_ is slow on CPU
                start += count
        return out

    def run_expert(self, expert: int, x: torch.Tensor, ops) -> torch.Tensor:
        if self.packed_experts:
            gate_up, down = self.packed_experts[expert]
            return cpu_linear.packed_linear(ops.silu_mul(cpu_linear.packed_linear(x, gate_up)), down)
        return F.linear(ops.silu_mul(F.linear(x, self.experts_gate_up[expert])), self.experts_down[expert])


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama layers with a SparseMoe for the MLP of its sparse layers. A family names its checkpoint's expert
    tensors: expert_parts maps (gate, up, down) to names with {e} for the expert's index, router the gate's."""
    router: str = ""
    expert_parts: tuple[str, str, str] = ("", "", "")

    def make_mlp(self, shape: MoeShape, layer_index: int) -> nn.Module:
        if shape.sparse_layers[layer_index]:
            return SparseMoe(shape)
        return MLP(shape.hidden_size, shape.intermediate_size)

    def checkpoint_tensor(self, checkpoint: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        prefix, _, suffix = name.partition("mlp.")
        if suffix == "gate.weight":
            return checkpoint[prefix + self.router]
        if suffix in ("experts_gate_up", "experts_down"):
            return self.stacked_experts(checkpoint, prefix, suffix == "experts_gate_up")
        return super().checkpoint_tensor(checkpoint, name)

    def stacked_experts(self, checkpoint: dict[str, torch.Tensor], prefix: str, gate_up: bool) -> torch.Tensor:
        gate, up, down = self.expert_parts
        num_experts = self.shape.num_experts
        if gate_up:
            return torch.stack([torch.cat([checkpoint[prefix + gate.format(e=e)], checkpoint[prefix + up.format(e=e)]])
                                for e in range(num_experts)])
        return torch.stack([checkpoint[prefix + down.format(e=e)] for e in range(num_experts)])
