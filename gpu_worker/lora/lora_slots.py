"""The device slots adapters run from, and the linears that run them: each of a decoder layer's linears (q|k|v,
o, gate|up, down) gets an A stack [max_loras, R, K] and a B stack (R: --max-lora-rank times its slices), and
computes base(x) + the LoRA product of each segment of rows that shares a slot: on CUDA by kernels/triton_lora.py,
B as [max_loras, N, R]; on a CPU by kernels/cpu_lora.py, B as [max_loras * R, N]. The scheduler says which adapter
each slot holds (StepRequest.lora_slots); an eager step of base-model rows only costs nothing more. A captured
decode graph (gpu_worker/cuda/cuda_graphs.py) reads its rows from GraphRows' fixed buffers instead, and launches
the kernels whether or not a row has an adapter."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpu_worker.lora.peft_adapter import LinearSlices, LoraWeights
from kernels import cpu_lora, torch_lora
from kernels.staging import staged
from kernels.torch_lora import LoraRows, segments_of

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")   # LayerPlan's fields, in order


def lora_kernel(device: torch.device):
    """add_lora(out, x, a_stack, b, rows): the CPU's, or Triton's on CUDA where it is installed, else torch's."""
    if device.type == "cpu":
        return cpu_lora.add_lora
    try:
        from kernels import triton_lora
        return triton_lora.add_lora
    except ImportError:
        return torch_lora.add_lora


class LoraSlots:
    def __init__(self, linears: dict[str, LinearSlices], num_layers: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.names: list[str | None] = [None] * max_loras   # the adapter each slot holds
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.add_lora = lora_kernel(device)
        for layer in range(num_layers):
            for linear, slices in linears.items():
                width = max_rank * len(slices.slice_sizes)
                b_shape = ((max_loras * width, slices.out_features) if self.add_lora is cpu_lora.add_lora
                           else (max_loras, slices.out_features, width))
                self.stacks[layer, linear] = (
                    torch.zeros(max_loras, width, slices.in_features, dtype=dtype, device=device),
                    torch.zeros(b_shape, dtype=dtype, device=device))
        self.rows: LoraRows | None = None   # the step's, set before its forward
        self.device = device

    @property
    def graphable(self) -> bool:
        """Whether a CUDA graph may hold the adapters' products: only the Triton kernel's launch grid is fixed by
        host bounds alone, the real segments read on the device."""
        return self.add_lora not in (cpu_lora.add_lora, torch_lora.add_lora)

    def graph_rows(self, max_rows: int) -> GraphRows:
        return GraphRows(max_rows, len(self.names), self.device)

    def place(self, slot: int, adapter: LoraWeights) -> None:
        """The adapter's weights into slot, replacing what the slot held."""
        for key, (a_stack, b_stack) in self.stacks.items():
            width = a_stack.shape[1]
            slot_b = b_stack[slot * width:(slot + 1) * width].t() if b_stack.dim() == 2 else b_stack[slot]
            a_stack[slot].zero_()
            slot_b.zero_()
            if key in adapter.linears:
                a, b = adapter.linears[key]
                a_stack[slot, :a.shape[0]].copy_(a)
                slot_b[:, :b.shape[1]].copy_(b)
        self.names[slot] = adapter.name

    def slot_of(self, name: str) -> int:
        """The slot holding adapter name; -1 for the base model ("")."""
        if not name:
            return -1
        if name not in self.names:
            raise ValueError(f"LoRA adapter {name!r} is not resident: the scheduler places it before its step")
        return self.names.index(name)

    def set_rows(self, row_slots: list[int]) -> None:
        self.rows = LoraRows.of(row_slots, self.device)

    def wrap(self, plans: list) -> list:
        """The model's layer plans with each linear an adapter may target running the slots' adapters too."""
        wrapped = []
        for layer, plan in enumerate(plans):
            linears = {name: LoraLinear(getattr(plan, name), *self.stacks[layer, name], self)
                       for name in LINEARS if (layer, name) in self.stacks}
            wrapped.append(replace(plan, **linears))
        return wrapped

    def wrap_modules(self, layers: list[dict[str, torch.nn.Module]]) -> None:
        """The same for a family whose layers call their linear modules themselves (Gemma's): each module's
        forward, in place."""
        for layer, linears in enumerate(layers):
            for name, module in linears.items():
                if (layer, name) in self.stacks:
                    module.forward = LoraLinear(module.forward, *self.stacks[layer, name], self)


class GraphRows:
    """The LoRA rows a captured decode graph reads: fixed device buffers each step refills, every slot a segment
    (the unused ones empty), so that one launch grid, bounded by the graph's batch size, serves every step."""

    def __init__(self, max_rows: int, num_slots: int, device: torch.device):
        self.order = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.segments = torch.zeros(3, num_slots, dtype=torch.int32, device=device)   # starts, lengths, slots
        self.num_slots, self.device = num_slots, device

    def view(self, size: int) -> LoraRows:
        """The rows of the graph of `size` rows: the host lists only bound the grid (any segment may hold every
        row); the kernels read the real segments from the buffers."""
        starts, lengths, slots = self.segments
        return LoraRows(self.order[:size], [0] * self.num_slots, [size] * self.num_slots,
                        list(range(self.num_slots)), starts, lengths, slots)

    def fill(self, row_slots: list[int]) -> None:
        """A step's rows (padding included, as -1) into the buffers, queued behind the previous replay."""
        order, starts, lengths, slots = segments_of(row_slots)
        pad = [0] * (self.num_slots - len(slots))
        host_order = torch.tensor(order + [0] * (len(row_slots) - len(order)), dtype=torch.long)
        host_segments = torch.tensor([starts + pad, lengths + pad, slots + pad], dtype=torch.int32)
        self.order[:len(row_slots)].copy_(staged(host_order, self.device), non_blocking=True)
        self.segments.copy_(staged(host_segments, self.device), non_blocking=True)


@dataclass
class LoraLinear:
    base: object          # the base linear's forward
    a_stack: torch.Tensor
    b_stack: torch.Tensor
    slots: LoraSlots

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.slots.rows is not None:
            self.slots.add_lora(out, x, self.a_stack, self.b_stack, self.slots.rows)
        return out
