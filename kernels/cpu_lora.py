"""The LoRA product on the CPU. A LoRA matmul is tiny (rank 16 against a few hundred columns): what it costs is
the calls, so the fewer the better. A step of few rows (decodes) computes every slot's product for every row in
one shrink, zeroes the blocks of other slots (a mask built once per step), and adds them all in one expand: the
FLOPs of max_loras adapters, a handful of calls whatever the adapters. A step of many rows (prefill chunks, whose
rows sharing an adapter are adjacent: the model runner orders them by slot) takes one shrink and one expand per run
of rows. Same sums as kernels/torch_lora.add_lora, the zero blocks adding exact zeros."""
from __future__ import annotations

import torch

from kernels.torch_lora import LoraRows

DENSE_MAX_ROWS = 256   # past it, max_loras adapters' FLOPs for every row outweigh the calls they save


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_rows: torch.Tensor,
             rows: LoraRows) -> None:
    """out += each row's adapter product, in place. a_stack [S, R, K]; b_rows [S * R, N]: each slot's B transposed,
    stacked (how LoraSlots keeps B on a CPU)."""
    num_slots, width, in_features = a_stack.shape
    if x.shape[0] <= DENSE_MAX_ROWS and len(rows.runs) > 1:
        shrunk = torch.mm(x, a_stack.view(num_slots * width, in_features).t())
        out.addmm_(shrunk.mul_(slot_mask(rows, x.shape[0], num_slots, width, x.dtype)), b_rows)
        return
    for first, end, slot in rows.runs:
        shrunk = torch.mm(x[first:end], a_stack[slot].t())
        out[first:end].addmm_(shrunk, b_rows[slot * width:(slot + 1) * width])


def slot_mask(rows: LoraRows, num_rows: int, num_slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, S * R]: ones in each row's slot's block, zeros elsewhere (all zeros for a base-model row)."""
    key = (num_slots, width, dtype)
    if key not in rows.masks:
        mask = torch.zeros(num_rows, num_slots * width, dtype=dtype)
        for first, end, slot in rows.runs:
            mask[first:end, slot * width:(slot + 1) * width] = 1
        rows.masks[key] = mask
    return rows.masks[key]
