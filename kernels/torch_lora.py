"""The LoRA products of one step, in torch: each segment of rows that shares an adapter gets x A^T B^T added to
the base layer's output (Punica's SGMV, S-LoRA), the reference the Triton kernel (kernels/triton_lora.py) keeps.

An adapter's weights for one of the model's linears sit in a stack of device slots: a_stack [S, R, K] and
b_stack [S, N, R], R the stack's width (the largest rank times the linear's slices: a fused q|k|v is three
adapters side by side, B block-diagonal), zero-padded past an adapter's own rank, its scaling folded into B."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.staging import tensor_on


@dataclass
class LoraRows:
    """A step's token rows grouped by the slot whose adapter they run with (rows of the base model left out):
    segment i is order[starts[i]:starts[i] + lengths[i]], all with slot slots[i]. The host lists drive the torch
    path; the device tensors (seg_*) the kernel's grid."""
    order: torch.Tensor        # [rows with an adapter] long: row indices, grouped by slot
    starts: list[int]
    lengths: list[int]
    slots: list[int]
    seg_starts: torch.Tensor   # int32 copies of the three lists, on the device
    seg_lengths: torch.Tensor
    seg_slots: torch.Tensor
    runs: list[tuple[int, int, int]] = field(default_factory=list)   # (first row, end row, slot): consecutive rows
    masks: dict = field(default_factory=dict)    # kernels/cpu_lora.py's, built once per step and stack width

    @classmethod
    def of(cls, row_slots: list[int], device: torch.device) -> LoraRows | None:
        """row_slots: each row's slot, -1 for the base model; None when no row has an adapter."""
        order, starts, lengths, slots = segments_of(row_slots)
        if not order:
            return None
        as_device = lambda xs, dtype: tensor_on(xs, dtype, device)  # noqa: E731
        return cls(as_device(order, torch.long), starts, lengths, slots, as_device(starts, torch.int32),
                   as_device(lengths, torch.int32), as_device(slots, torch.int32), runs_of(row_slots))


def segments_of(row_slots: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(order, starts, lengths, slots): the rows with an adapter grouped by slot, in slot order."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    order, starts, lengths, slots = [], [], [], []
    for slot, rows in sorted(by_slot.items()):
        starts.append(len(order))
        lengths.append(len(rows))
        slots.append(slot)
        order.extend(rows)
    return order, starts, lengths, slots


def runs_of(row_slots: list[int]) -> list[tuple[int, int, int]]:
    """The runs of consecutive rows with one adapter: (first, end, slot), base-model rows left out."""
    runs, first = [], 0
    for row in range(1, len(row_slots) + 1):
        if row == len(row_slots) or row_slots[row] != row_slots[first]:
            if row_slots[first] >= 0:
                runs.append((first, row, row_slots[first]))
            first = row
    return runs


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             rows: LoraRows) -> None:
    """out[r] += (x[r] @ a_stack[slot].T) @ b_stack[slot].T for every row r of every segment, in place.
    x [T, K], out [T, N]; rows outside every segment keep the base layer's output."""
    for start, length, slot in zip(rows.starts, rows.lengths, rows.slots):
        index = rows.order[start:start + length]
        shrunk = x.index_select(0, index) @ a_stack[slot].t()
        # index_put_ rather than index_add_, whose CPU kernel takes ~25 ms for a few rows (torch 2.13)
        out.index_put_((index,), shrunk @ b_stack[slot].t(), accumulate=True)
