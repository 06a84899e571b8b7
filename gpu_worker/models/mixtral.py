"""Mixtral: the Llama layers with a mixture of experts in every layer (top-k renormalised, routing weights in
float32)."""
from __future__ import annotations

from gpu_worker.model import ModelShape
from gpu_worker.models.moe import MoeForCausalLM, MoeShape


class MixtralForCausalLM(MoeForCausalLM):
    router = "block_sparse_moe.gate.weight"
    expert_parts = ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                    "block_sparse_moe.experts.{e}.w2.weight")

    @classmethod
    def shape_from_config(cls, config) -> ModelShape:
        return MoeShape.from_hf_config(
            config, num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.intermediate_size, sparse_layers=(True,) * config.num_hidden_layers)
