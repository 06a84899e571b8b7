"""Loads Hugging Face safetensors checkpoints into Ferry's layers; each model names the checkpoint tensors its
parameters come from (model.checkpoint_tensor).

Streamed: a tensor is read from its file when a parameter asks for it and copied into the parameter, which the
loader allocated on the target device in the target dtype; so host memory holds a few tensors at a time, and
device memory the model plus the largest tensor in flight, never the checkpoint in fp32."""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
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


def language_model_name(stored: str) -> str:
    """A checkpoint tensor's name as Ferry's model names it: "model." dropped, and the language model's prefix of
    an image-text checkpoint ("language_model.model." as Gemma 3 was published, "model.language_model." as
    transformers 5 saves it); the other parts' tensors keep theirs and are never read."""
    name = stored.removeprefix("model.")
    if name.startswith("language_model."):
        name = name.removeprefix("language_model.").removeprefix("model.")
    return name


class Checkpoint(Mapping):
    """The checkpoint's tensors by name (language_model_name), each read from its file when asked for. The file is
    opened for that one read: a handle kept open would keep every page it had read mapped, in the process's RSS."""

    def __init__(self, model_dir: Path):
        self.files: dict[str, tuple[Path, str]] = {}
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                self.files.update((language_model_name(name), (path, name)) for name in f.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        path, stored_name = self.files[name]
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(stored_name)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor, read without the rest of it."""
        path, stored_name = self.files[name]
        with safe_open(str(path), framework="pt") as f:
            part = f.get_slice(stored_name)
            return part[start:stop] if dim == 0 else part[:, start:stop]

    def __contains__(self, name: object) -> bool:   # Mapping's would read the tensor to find out
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def load_weights(model: nn.Module, checkpoint: Mapping[str, torch.Tensor]) -> None:
    """Copy each parameter from the checkpoint (a Checkpoint, or a rank's view of one), converted to the
    parameter's dtype and device on the way."""
    for name, param in model.named_parameters():
        source = model.checkpoint_tensor(checkpoint, name)
        if source.shape != param.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(source.shape)} != model {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(source)


def fused_checkpoint_tensor(checkpoint: Mapping[str, torch.Tensor], name: str,
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
