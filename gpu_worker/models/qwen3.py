"""Qwen3: the Llama layers with an RMSNorm over each head of q and k before the rotary, and no qkv bias."""
from __future__ import annotations

from gpu_worker.model import ModelShape
from gpu_worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def shape_from_config(cls, config) -> ModelShape:
        return ModelShape.from_hf_config(config, qk_norm=True)
