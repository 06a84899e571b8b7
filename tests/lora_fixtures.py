"""PEFT adapters of the tiny model, and the reference Ferry's LoRA serving is held to: PEFT's merged model."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft_adapter(base_dir: Path, out_dir: Path, rank: int, seed: int, targets: list[str] = ALL_TARGETS,
                       lora_alpha: int | None = None, use_rslora: bool = False) -> Path:
    """A LoRA adapter of the model at base_dir in PEFT's format, with random A and B (PEFT starts B at zero, which
    would change nothing), scaled so that it changes the greedy tokens."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=lora_alpha or 2 * rank, target_modules=targets, lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3 / rank ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path | None):
    """PEFT's adapter merged into the base model's weights (the base model itself for None)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
