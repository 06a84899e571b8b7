"""The Triton LoRA kernels (shrink, expand) against kernels.torch_lora, in Triton's interpreter on CPU.

As in test_kernels.py, TRITON_INTERPRET is set before triton is imported, and the kernel modules are imported
afresh if triton came in compiled.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from kernels import torch_lora  # noqa: E402
from kernels.torch_lora import LoraRows  # noqa: E402
from tests.conftest import import_interpreted_kernels  # noqa: E402

triton_lora = import_interpreted_kernels("kernels.triton_lora")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
NUM_SLOTS = 6


def ranks(width: int) -> dict[int, int]:
    """slot -> the adapter's own rank: slot 5's fills the stack's width, slot 2's is far below it."""
    return {0: 16, 2: 5, 5: width}


def make_stacks(width: int, in_features: int, out_features: int, dtype: torch.dtype,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters in ranks' slots, zero past their rank; the slots no row uses hold garbage that must never be read."""
    a_stack = torch.randn(NUM_SLOTS, width, in_features, generator=generator) * 100
    b_stack = torch.randn(NUM_SLOTS, out_features, width, generator=generator) * 100
    for slot, rank in ranks(width).items():
        a_stack[slot] = 0
        b_stack[slot] = 0
        a_stack[slot, :rank] = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
        b_stack[slot, :, :rank] = torch.randn(out_features, rank, generator=generator) / rank ** 0.5
    return a_stack.to(dtype), b_stack.to(dtype)


def interleaved_slots(counts: dict[int, int], generator: torch.Generator) -> list[int]:
    """counts: slot -> how many rows run with it (-1: the base model), shuffled together."""
    row_slots = [slot for slot, count in counts.items() for _ in range(count)]
    return [row_slots[i] for i in torch.randperm(len(row_slots), generator=generator).tolist()]


STEPS = {
    "prefill": {5: 70, -1: 13, 2: 17, 0: 1},   # 101 rows; slot 5's segment spans two row tiles of 64
    "decode": {0: 2, -1: 1, 5: 1, 2: 1},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("width,in_features,out_features", [(24, 72, 80), (72, 40, 24)])
def test_add_lora_matches_torch_per_segment_and_leaves_base_rows_alone(
        step: str, width: int, in_features: int, out_features: int, dtype: torch.dtype) -> None:
    """Uneven segments of 3 adapters interleaved with base rows; K, N and R not multiples of their tiles (the second
    shape's R spans two rank tiles); out a column slice of a wider output, as a fused projection's is."""
    generator = torch.Generator().manual_seed(0)
    row_slots = interleaved_slots(STEPS[step], generator)
    rows = LoraRows.of(row_slots, torch.device("cpu"))
    a_stack, b_stack = make_stacks(width, in_features, out_features, dtype, generator)
    x = torch.randn(len(row_slots), in_features, generator=generator).to(dtype)
    fused = torch.randn(len(row_slots), out_features + 8, generator=generator).to(dtype)
    before = fused.clone()
    out = fused[:, 8:]
    expected = out.clone()
    torch_lora.add_lora(expected, x, a_stack, b_stack, rows)

    triton_lora.add_lora(out, x, a_stack, b_stack, rows)

    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    base = [row for row, slot in enumerate(row_slots) if slot < 0]
    adapted = [row for row, slot in enumerate(row_slots) if slot >= 0]
    assert torch.equal(out[base], before[base, 8:])
    assert torch.equal(fused[:, :8], before[:, :8])
    assert (out[adapted].float() - before[adapted, 8:].float()).abs().mean() > 0.1  # the adapters did add
