"""The CPU LoRA product (one dense shrink and expand for few rows, one per run of rows for many) equals the torch
reference, base-model rows untouched."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_lora, torch_lora
from kernels.torch_lora import LoraRows


@pytest.mark.parametrize("num_rows", [7, cpu_lora.DENSE_MAX_ROWS + 5])
def test_the_cpu_product_equals_the_reference_for_few_and_many_rows(num_rows):
    torch.manual_seed(0)
    num_slots, width, k, n = 4, 12, 40, 24
    x = torch.randn(num_rows, k)
    a_stack, b_stack = torch.randn(num_slots, width, k), torch.randn(num_slots, n, width)
    b_rows = b_stack.transpose(1, 2).reshape(num_slots * width, n)
    row_slots = [(-1, 2, 2, 0, 3, -1, 3)[i * 7 // num_rows] for i in range(num_rows)]   # runs and base rows
    rows = LoraRows.of(row_slots, torch.device("cpu"))
    base = torch.randn(num_rows, n)
    expected, got = base.clone(), base.clone()
    torch_lora.add_lora(expected, x, a_stack, b_stack, rows)
    cpu_lora.add_lora(got, x, a_stack, b_rows, rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    base_rows = [i for i, slot in enumerate(row_slots) if slot < 0]
    assert torch.equal(got[base_rows], base[base_rows])
    assert not torch.allclose(got, base)


def test_runs_are_the_consecutive_rows_of_one_adapter():
    assert torch_lora.runs_of([-1, 2, 2, 0, -1, -1, 0, 0]) == [(1, 3, 2), (3, 4, 0), (6, 8, 0)]
