"""Qwen3-MoE: Qwen3's attention (q/k norms) with a mixture of experts in its sparse layers and a dense MLP in
the others (mlp_only_layers, decoder_sparse_step)."""
from __future__ import annotations

from gpu_worker.model import ModelShape
from gpu_worker.models.moe import ExpertNames, MoeForCausalLM, MoeShape


def sparse_layers(config) -> tuple[bool, ...]:
    only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return tuple(i not in only_mlp and config.num_experts > 0 and (i + 1) % step == 0
                 for i in range(config.num_hidden_layers))


class Qwen3MoeForCausalLM(MoeForCausalLM):
    expert_names = ExpertNames("mlp", gate="gate_proj", up="up_proj", down="down_proj")

    @classmethod
    def shape_from_config(cls, config) -> ModelShape:
        return MoeShape.from_hf_config(
            config, qk_norm=True, num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size, normalize_top_k=bool(config.norm_topk_prob),
            round_routing_weights=True, sparse_layers=sparse_layers(config))
