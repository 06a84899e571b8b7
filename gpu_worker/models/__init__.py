"""Ferry's model families by Hugging Face `model_type`: a family is one module here and one entry in FAMILIES.

A family's model class is built from its shape and keeps LlamaForCausalLM's interface:
  shape_from_config(config) -> ModelShape    (classmethod: what the model and the KV pool are sized from)
  checkpoint_tensor(checkpoint, name)        the checkpoint tensor a parameter is loaded from
  load_rope(config, max_positions, device)   its rotary tables
  forward(input_ids, positions, kv_caches, batch) -> hidden; compute_logits(hidden) -> logits
  attention_windows, attention_softcap       its layers' sliding windows (0 left out), its score softcap (0: none)
"""
from __future__ import annotations

import importlib

FAMILIES = {  # model_type -> "module:class" under gpu_worker/models
    "llama": "llama:LlamaForCausalLM",
    "mistral": "llama:LlamaForCausalLM",
    "qwen2": "llama:LlamaForCausalLM",
    "qwen3": "qwen3:Qwen3ForCausalLM",
    "phi3": "phi3:Phi3ForCausalLM",
    "mixtral": "mixtral:MixtralForCausalLM",
    "qwen3_moe": "qwen3_moe:Qwen3MoeForCausalLM",
    "gemma2": "gemma:GemmaForCausalLM",
    "gemma3_text": "gemma:GemmaForCausalLM",
}


def model_class(model_type: str) -> type:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    module_name, class_name = FAMILIES[model_type].split(":")
    return getattr(importlib.import_module(f"gpu_worker.models.{module_name}"), class_name)
