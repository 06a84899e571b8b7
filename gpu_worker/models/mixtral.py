"""Mixtral: the Llama layers with a mixture of experts in every layer (top-k renormalised, routing weights in
float32)."""
from __future__ import annotations

from gpu_worker.model import ModelShape
from gpu_worker.models.moe import ExpertNames, MoeForCausalLM, MoeShape


class MixtralForCausalLM(MoeForCausalLM):
    expert_names = ExpertNames("block_sparse_moe", gate="w1", up="w3", down="w2")

    @classmethod
    def shape_from_config(cls, config) -> ModelShape:
        return MoeShape.from_hf_config(
            config, num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.intermediate_size, sparse_layers=(True,) * config.num_hidden_layers)
