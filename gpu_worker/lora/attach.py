"""LoRA on a loaded model: its linears wrapped to run the device slots' adapters, and the store adapters load into."""
from __future__ import annotations

import torch

from gpu_worker.lora.adapter_store import AdapterStore
from gpu_worker.lora.lora_slots import LoraSlots
from gpu_worker.lora.peft_adapter import model_linears, read_adapter
from protos import worker_pb2


def attach_lora(model: torch.nn.Module, shape, req: worker_pb2.InitRequest, dtype: torch.dtype,
                device: torch.device) -> tuple[LoraSlots, AdapterStore]:
    """ValueError for a family whose layers are not Ferry's planned decoder layers (Gemma's own)."""
    if not hasattr(model, "plan_layers"):
        raise ValueError(f"LoRA is not supported for {type(model).__name__} yet")
    max_loras, max_rank = max(1, req.max_loras), max(1, req.max_lora_rank)
    plans = model.plan_layers()
    linears = model_linears(shape, has_dense_mlp=plans[0].gate_up_proj is not None)
    slots = LoraSlots(linears, shape.num_layers, max_loras, max_rank, dtype, device)
    model.layer_plans = slots.wrap(plans)

    def read(name: str, path: str):
        return read_adapter(name, path, linears, shape.num_layers, max_rank, dtype)
    return slots, AdapterStore(read, req.max_cpu_loras or max_loras)
