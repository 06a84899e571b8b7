"""Loads Hugging Face safetensors checkpoints into Ferry's layers; each model names the checkpoint tensors its
parameters come from (model.checkpoint_tensor)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


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


def load_weights(model: nn.Module, model_dir: Path) -> None:
    checkpoint = read_checkpoint(model_dir)
    for name, param in model.named_parameters():
        source = model.checkpoint_tensor(checkpoint, name)
        if source.shape != param.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(source.shape)} != model {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(source)


def fused_checkpoint_tensor(checkpoint: dict[str, torch.Tensor], name: str,
                            fused: dict[str, tuple[str, ...]]) -> torch.Tensor:
    """The checkpoint's tensor of that name, or the parts a fused parameter is made of (fused: Ferry parameter
    suffix -> the checkpoint's parts, concatenated along dim 0), or the embedding for an untied-in-name lm_head."""
    if name in checkpoint:
        return checkpoint[name]
    if name == "lm_head.weight":
        return checkpoint["embed_tokens.weight"]
    for suffix, parts in fused.items():
        if name.endswith(suffix):
            prefix = name[: -len(suffix)]
            return torch.cat([checkpoint[prefix + p] for p in parts], dim=0)
    raise ValueError(f"weight {name} missing from the checkpoint")
