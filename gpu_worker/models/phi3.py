"""Phi-3: the Llama layers with qkv and gate_up already fused in the checkpoint, and LongRoPE scaling
(gpu_worker/model.py: longrope_cos_sin)."""
from __future__ import annotations

from gpu_worker.model import ModelShape
from gpu_worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    fused_weights = {}   # the checkpoint's qkv_proj and gate_up_proj are Ferry's parameters as they are

    @classmethod
    def shape_from_config(cls, config) -> ModelShape:
        return ModelShape.from_hf_config(config)
