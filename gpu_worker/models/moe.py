"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k SiLU-gated experts, and the
tokens are grouped by expert so that every expert runs once, on all its tokens, per step."""
from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.cpu import cpu_linear
from gpu_worker.model import ModelShape
from gpu_worker.models.llama import MLP, LlamaForCausalLM
from kernels import cpu_moe


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
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] = []   # on the CPU in bf16: oneDNN's layout
        self.cpu_kernel = None                                              # on the CPU in fp32: kernels/cpu_moe
        self.grouped_weights: tuple[torch.Tensor, torch.Tensor] = ()

    def pack_experts(self) -> None:
        """The weights packed once for the CPU, and the stacked tensors dropped: for kernels/cpu_moe's grouped
        linear (all experts in one call) where it takes them, else per expert for oneDNN, as cpu_linear packs the
        dense linears (plain F.linear on CPU is slower per call, and a step calls it twice per expert)."""
        if cpu_moe.supports(self.experts_gate_up) and cpu_moe.supports(self.experts_down):
            self.cpu_kernel = cpu_moe.extension()
        if self.cpu_kernel is not None:
            self.grouped_weights = (cpu_moe.pack(self.experts_gate_up), cpu_moe.pack(self.experts_down))
        else:
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
        if self.cpu_kernel is not None:
            per_slot = self.run_grouped(hidden, weights, experts, ops)
        elif not self.packed_experts and grouped_mm_works(hidden.device, hidden.dtype, self.experts_down.shape):
            per_slot = self.run_grouped_mm(hidden, weights, experts, ops)
        else:
            per_slot = self.run_per_expert(hidden, weights, experts, ops)
        out = per_slot[:, 0] + per_slot[:, 1] if self.top_k > 1 else per_slot[:, 0].clone()
        for slot in range(2, self.top_k):   # a token's outputs add up in expert order, as transformers'
            out += per_slot[:, slot]
        return out

    def run_grouped(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ops) -> torch.Tensor:
        """Each token's weighted expert outputs [T, k, hidden], its experts in ascending order: kernels/cpu_moe."""
        source, scale, destination, counts = self.cpu_kernel.group_by_expert(experts, weights.float(),
                                                                             self.num_experts)
        gate_up, down = self.grouped_weights
        activated = ops.silu_mul(self.cpu_kernel.grouped_linear(hidden, counts, gate_up, source=source))
        out = self.cpu_kernel.grouped_linear(activated, counts, down, scale=scale, destination=destination)
        return out.view(-1, self.top_k, hidden.shape[-1])

    def run_grouped_mm(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                       ops) -> torch.Tensor:
        """As run_per_expert in two grouped GEMMs (torch._grouped_mm) whose group ends stay a device tensor: the
        step never waits for the routing to reach the host (on a GPU, one launch for all experts, no sync)."""
        experts, weights, order = self.grouped_by_expert(experts, weights)
        flat = experts.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=flat.device)
        ends = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
        grouped = hidden[order // self.top_k]
        activated = ops.silu_mul(torch._grouped_mm(grouped, self.experts_gate_up.transpose(1, 2), offs=ends))
        out = torch._grouped_mm(activated, self.experts_down.transpose(1, 2), offs=ends)
        out = out * weights.flatten()[order, None]
        return out[order.argsort()].to(hidden.dtype).view(-1, self.top_k, hidden.shape[-1])

    def grouped_by_expert(self, experts: torch.Tensor, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's experts in ascending order with their weights, and the (token, slot) pairs' order grouped
        by expert."""
        experts, slot_order = experts.sort(dim=-1)
        return experts, weights.gather(-1, slot_order), experts.flatten().argsort(stable=True)

    def run_per_expert(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                       ops) -> torch.Tensor:
        """As run_grouped, in torch ops: one pair of linears per expert that has tokens."""
        experts, weights, order = self.grouped_by_expert(experts, weights)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()
        ranges = [(expert, start, start + count) for expert, (start, count)
                  in enumerate(zip(itertools.accumulate([0] + counts), counts)) if count]
        grouped = hidden[order // self.top_k]
        gate_up = torch.cat([self.expert_linear(grouped[start:end], expert, 0) for expert, start, end in ranges])
        activated = ops.silu_mul(gate_up)
        out = torch.cat([self.expert_linear(activated[start:end], expert, 1) for expert, start, end in ranges])
        out = out * weights.flatten()[order, None]
        return out[order.argsort()].to(hidden.dtype).view(-1, self.top_k, hidden.shape[-1])

    def expert_linear(self, x: torch.Tensor, expert: int, which: int) -> torch.Tensor:
        """which 0: the expert's gate_up projection, 1: its down projection."""
        if self.packed_experts:
            return cpu_linear.packed_linear(x, self.packed_experts[expert][which])
        return F.linear(x, (self.experts_gate_up, self.experts_down)[which][expert])


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype, down_shape: torch.Size) -> bool:
    """Whether torch._grouped_mm takes these experts' shapes in this dtype on this device (its kernels want 16-byte
    aligned rows, and some builds lack a dtype): tried once on small tensors of the same widths."""
    _, hidden, inner = down_shape
    try:
        x = torch.zeros(2, hidden, dtype=dtype, device=device)
        w = torch.zeros(1, inner, hidden, dtype=dtype, device=device).transpose(1, 2)
        ends = torch.full((1,), 2, dtype=torch.int32, device=device)
        torch._grouped_mm(x, w, offs=ends)
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoint keeps a layer's mixture of experts: under `block`, the router's `gate.weight` and
    `experts.{e}.<part>.weight` for each expert's gate, up and down projections."""
    block: str
    gate: str
    up: str
    down: str

    @property
    def router(self) -> str:
        return f"{self.block}.gate.weight"

    def expert(self, part: str, e: int) -> str:
        return f"{self.block}.experts.{e}.{part}.weight"


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama layers with a SparseMoe for the MLP of its sparse layers; a family names its expert tensors."""
    expert_names: ExpertNames
    capturable = False   # the per-expert fallback counts tokens on the host; the grouped path never ran in a graph

    def make_mlp(self, shape: MoeShape, layer_index: int) -> nn.Module:
        if shape.sparse_layers[layer_index]:
            return SparseMoe(shape)
        return MLP(shape.hidden_size, shape.intermediate_size)

    def checkpoint_tensor(self, checkpoint: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        prefix, _, suffix = name.partition("mlp.")
        if suffix == "gate.weight":
            return checkpoint[prefix + self.expert_names.router]
        if suffix in ("experts_gate_up", "experts_down"):
            return self.stacked_experts(checkpoint, prefix, suffix == "experts_gate_up")
        return super().checkpoint_tensor(checkpoint, name)

    def stacked_experts(self, checkpoint: Mapping[str, torch.Tensor], prefix: str, gate_up: bool) -> torch.Tensor:
        names = self.expert_names
        parts = (names.gate, names.up) if gate_up else (names.down,)
        return torch.stack([torch.cat([checkpoint[prefix + names.expert(part, e)] for part in parts])
                            for e in range(self.shape.num_experts)])
