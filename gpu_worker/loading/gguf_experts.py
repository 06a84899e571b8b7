"""Mixtral from GGUF. llama.cpp writes it as the `llama` architecture with `expert_count` in the metadata and each
layer's experts stacked in `blk.N.ffn_{gate,up,down}_exps.weight` [experts, out, in] (files from before April 2024:
one `blk.N.ffn_{gate,up,down}.E.weight` per expert), which transformers' GGUF loader does not map: it would build a
dense Llama and leave its MLPs at their random init. transformers reads the rest as a Llama (config, tokenizer,
attention un-permuted); here the experts are dequantized by gguf and split under Mixtral's checkpoint names."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from gpu_worker.loading.gguf_config import GgufFile, complete_config

EXPERT_WEIGHTS = {"gate": "w1", "down": "w2", "up": "w3"}   # llama.cpp's ffn_{x}_exps -> Mixtral's experts.E.{w}
EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|down|up)(_exps|\.(?P<expert>\d+))\.weight")
ROUTER = re.compile(r"blk\.(?P<layer>\d+)\.ffn_gate_inp\.weight")


def has_experts(gguf_file: GgufFile) -> bool:
    return gguf_file.arch == "llama" and bool(gguf_file.value("expert_count"))


def convert_mixtral(path: Path, gguf_file: GgufFile, directory: Path) -> None:
    """Write the file's Mixtral as a Hugging Face checkpoint (safetensors, config, generation config)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    llama = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    complete_config(llama, gguf_file)
    config = mixtral_config(llama, gguf_file)
    state = llama_tensors(path, llama) | mixture_tensors(gguf_file)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({name: t.contiguous() for name, t in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)


def mixtral_config(llama, gguf_file: GgufFile):
    """transformers' Llama config of the file, as a Mixtral with the file's expert counts."""
    from transformers import MixtralConfig

    fields = llama.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "quantization_config"):
        fields.pop(key, None)
    return MixtralConfig(**fields, architectures=["MixtralForCausalLM"],
                         num_local_experts=int(gguf_file.value("expert_count")),
                         num_experts_per_tok=int(gguf_file.value("expert_used_count")))


def llama_tensors(path: Path, llama_config) -> dict[str, torch.Tensor]:
    """The tensors of the file a dense Llama has (embeddings, attention, norms, head), read by transformers."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):   # only its parameter names are used
        llama = LlamaForCausalLM(llama_config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=llama)["tensors"]


def mixture_tensors(gguf_file: GgufFile) -> dict[str, torch.Tensor]:
    """Each layer's router and its experts, one tensor per expert, under Mixtral's checkpoint names."""
    from gguf.quants import dequantize

    state = {}
    for tensor in gguf_file.reader.tensors:
        if match := ROUTER.fullmatch(tensor.name):
            state[f"model.layers.{match['layer']}.block_sparse_moe.gate.weight"] = as_torch(
                dequantize(tensor.data, tensor.tensor_type))
        elif match := EXPERTS.fullmatch(tensor.name):
            weights = dequantize(tensor.data, tensor.tensor_type)
            experts = {int(match["expert"]): weights} if match["expert"] else dict(enumerate(weights))
            prefix = f"model.layers.{match['layer']}.block_sparse_moe.experts"
            state |= {f"{prefix}.{e}.{EXPERT_WEIGHTS[match['part']]}.weight": as_torch(w) for e, w in experts.items()}
    return state


def as_torch(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32))
