"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), read and checked against the
model, its weights laid out for Ferry's fused linears.

PEFT adds scaling * B(A(x)) to each targeted nn.Linear, scaling = lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora). Ferry computes q|k|v and gate|up as one linear each: an adapter's A matrices of a fused linear are
stacked ([slices * r, K]) and its B matrices placed block-diagonally ([N, slices * r], scaling folded in), so one
shrink and one expand serve the fused linear; a slice the adapter leaves out is zeros."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# PEFT's module name -> (Ferry's linear, the slice of it; None: the whole of an already fused linear, as Phi-3's)
PEFT_TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", 0),
}
LORA_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
UNSUPPORTED_SETTINGS = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform")


class AdapterRefused(ValueError):
    """The adapter cannot run on this model; the message says why."""


@dataclass(frozen=True)
class LinearSlices:
    """One of the model's linears as an adapter sees it: its input width and its output slices (q, k, v...)."""
    in_features: int
    slice_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.slice_sizes)


@dataclass
class LoraWeights:
    name: str
    rank: int
    target_modules: list[str]
    linears: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]   # (layer, linear) -> A, B (fused, scaled)

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.linears.values())


def model_linears(shape, has_dense_mlp: bool) -> dict[str, LinearSlices]:
    """The linears an adapter may target, for a model of this shape (a mixture of experts: attention only)."""
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    linears = {"qkv_proj": LinearSlices(shape.hidden_size, (q_size, kv_size, kv_size)),
               "o_proj": LinearSlices(q_size, (shape.hidden_size,))}
    if has_dense_mlp:
        linears["gate_up_proj"] = LinearSlices(shape.hidden_size, (shape.intermediate_size,) * 2)
        linears["down_proj"] = LinearSlices(shape.intermediate_size, (shape.hidden_size,))
    return linears


def read_adapter(name: str, path: str | Path, linears: dict[str, LinearSlices], num_layers: int, max_rank: int,
                 dtype: torch.dtype) -> LoraWeights:
    """The adapter at path, checked against the model's linears; AdapterRefused naming what does not fit."""
    directory = Path(path)
    config = adapter_config(directory)
    rank, scaling = checked_rank(config, max_rank)
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterRefused(f"{directory}: no adapter_model.safetensors (only PEFT's safetensors format is read)")
    pairs = lora_pairs(load_file(str(weights_file)), num_layers)
    targets = sorted({module for _, module in pairs})
    fused = {}
    for layer, linear in sorted({(layer, PEFT_TARGETS[module][0]) for layer, module in pairs}):
        if linear not in linears:
            raise AdapterRefused(f"adapter {name!r} targets {linear} of layer {layer}: this model has no such dense "
                                 f"linear (a mixture of experts takes adapters on attention only)")
        fused[layer, linear] = fused_pair(pairs, layer, linear, linears[linear], rank, scaling, dtype)
    return LoraWeights(name, rank, targets, fused)


def adapter_config(directory: Path) -> dict:
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterRefused(f"{directory}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterRefused(f"{config_file}: not JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterRefused(f"{directory}: peft_type {config.get('peft_type')!r} is not LORA")
    for setting in UNSUPPORTED_SETTINGS:
        if config.get(setting):
            raise AdapterRefused(f"{directory}: {setting} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterRefused(f"{directory}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise AdapterRefused(f"{directory}: fan_in_fan_out (Conv1D layers) is not supported")
    return config


def checked_rank(config: dict, max_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterRefused(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterRefused(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    return rank, alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank


def lora_pairs(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, PEFT module) -> {"A": ..., "B": ...}; AdapterRefused for a tensor of anything else."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = LORA_KEY.search(key)
        if match is None or match[2] not in PEFT_TARGETS:
            raise AdapterRefused(f"tensor {key}: only LoRA on {', '.join(PEFT_TARGETS)} is supported")
        layer = int(match[1])
        if layer >= num_layers:
            raise AdapterRefused(f"tensor {key}: layer {layer}, but the model has {num_layers} layers")
        pairs.setdefault((layer, match[2]), {})[match[3]] = tensor
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterRefused(f"layer {layer} {module}: lora_A and lora_B must both be present")
    return pairs


def fused_pair(pairs, layer: int, linear: str, slices: LinearSlices, rank: int, scaling: float,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked A [slices * r, K] and block-diagonal, scaled B [N, slices * r] of one linear."""
    num_slices = len(slices.slice_sizes)
    a = torch.zeros(num_slices * rank, slices.in_features)
    b = torch.zeros(slices.out_features, num_slices * rank)
    for module, (target, index) in PEFT_TARGETS.items():
        if target != linear or (layer, module) not in pairs:
            continue
        pair = pairs[layer, module]
        first, count = (0, num_slices) if index is None else (index, 1)
        out_start = sum(slices.slice_sizes[:first])
        out_size = sum(slices.slice_sizes[first:first + count])
        expect_a, expect_b = (rank, slices.in_features), (out_size, rank)
        if tuple(pair["A"].shape) != expect_a or tuple(pair["B"].shape) != expect_b:
            raise AdapterRefused(f"layer {layer} {module}: lora_A {list(pair['A'].shape)} and lora_B "
                                 f"{list(pair['B'].shape)} do not fit this model (expected {list(expect_a)} and "
                                 f"{list(expect_b)})")
        a[first * rank:(first + 1) * rank] = pair["A"].float()
        b[out_start:out_start + out_size, first * rank:(first + 1) * rank] = pair["B"].float() * scaling
    return a.to(dtype), b.to(dtype)
