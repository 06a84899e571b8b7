"""LoRA on a loaded model: its linears wrapped to run the device slots' adapters, and the store adapters load into."""
from __future__ import annotations

from dataclasses import replace

import torch

from gpu_worker.lora.adapter_store import AdapterStore
from gpu_worker.lora.lora_slots import LoraSlots
from gpu_worker.lora.peft_adapter import LoraWeights, model_linears, read_adapter
from gpu_worker.parallel.group import TensorParallel
from gpu_worker.parallel.sharding import shard_adapter_linears
from protos import worker_pb2


def attach_lora(model: torch.nn.Module, shape, req: worker_pb2.InitRequest, dtype: torch.dtype,
                device: torch.device, tp: TensorParallel | None = None, whole_shape=None
                ) -> tuple[LoraSlots, AdapterStore]:
    """The model's layer plans (or, for a family whose layers call their own linears, its adapter_linears) wrapped.
    Under tensor parallelism (shape: the rank's, whole_shape: the model's) adapters are checked against the whole
    model and each rank keeps its cut of them."""
    max_loras, max_rank = max(1, req.max_loras), max(1, req.max_lora_rank)
    plans = model.plan_layers() if hasattr(model, "plan_layers") else None
    dense = plans is None or plans[0].gate_up_proj is not None
    linears = model_linears(shape, has_dense_mlp=dense)
    slots = LoraSlots(linears, shape.num_layers, max_loras, max_rank, dtype, device)
    if plans is not None:
        model.layer_plans = slots.wrap(plans)
    else:
        slots.wrap_modules(model.adapter_linears())
    whole_linears = model_linears(whole_shape, has_dense_mlp=dense) if tp is not None else linears

    def read(name: str, path: str) -> LoraWeights:
        weights = read_adapter(name, path, whole_linears, shape.num_layers, max_rank, dtype)
        if tp is None:
            return weights
        return replace(weights, linears=shard_adapter_linears(weights.linears, whole_shape, tp))
    return slots, AdapterStore(read, req.max_cpu_loras or max_loras)
