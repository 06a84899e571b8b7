"""Loads Hugging Face safetensors checkpoints into Ferry's fused layers."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_worker.model import LlamaForCausalLM

FUSED = {  # Ferry parameter suffix -> the checkpoint's parts, concatenated along dim 0
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {model_dir}")
    return files


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    checkpoint = read_checkpoint(model_dir)
    for name, param in model.named_parameters():
        source = checkpoint_tensor(checkpoint, name)
        if source.shape != param.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(source.shape)} != model {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(source)


def checkpoint_tensor(checkpoint: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name == "lm_head.weight" and name not in checkpoint:
        return checkpoint["embed_tokens.weight"]
    for suffix, parts in FUSED.items():
        if name.endswith(suffix):
            prefix = name[: -len(suffix)]
            return torch.cat([checkpoint[prefix + p] for p in parts], dim=0)
    if name not in checkpoint:
        raise ValueError(f"weight {name} missing from the checkpoint")
    return checkpoint[name]
