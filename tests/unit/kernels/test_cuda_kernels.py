"""The Triton kernels compiled for a GPU, at real models' shapes, against the torch reference on the same GPU.

Runs only where CUDA is available and the kernels are compiled (TRITON_INTERPRET unset or 0, as
scripts/gpu_check.sh runs this file); everywhere else it is skipped. test_kernels.py beside it checks the same
kernels in the interpreter, on the CPU, at small shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

from kernels import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU and compiled (not interpreted) Triton kernels")

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (query heads, KV heads, head_dim, sliding window or 0) of the models whose kernels' variants must compile and agree
SHAPES = {"smollm2": (9, 3, 64, 0), "llama3-8b": (32, 8, 128, 0), "gemma3-4b": (8, 4, 256, 0),
          "gemma3-4b-local": (8, 4, 256, 1024)}
CONTEXTS = [1, 17, 300, 2100]


@pytest.fixture(scope="module")
def triton_paged():
    from kernels import triton_paged
    return triton_paged


def random_pool(context_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A head-major pool (the worker's layout, seen through a transposed view) of shuffled blocks, and the tables."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = [-(-length // BLOCK_SIZE) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (2, num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
    pool = torch.randn(shape, generator=generator, device="cuda").to(dtype)
    k_cache, v_cache = pool[0].transpose(1, 2), pool[1].transpose(1, 2)
    order = torch.randperm(num_blocks, generator=generator, device="cuda").to(torch.int32)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32, device="cuda")
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = order[used:used + count]
        used += count
    return k_cache, v_cache, tables


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


def expected_outputs(query, k_cache, v_cache, tables, context_lens, query_lens, scale, window) -> torch.Tensor:
    outputs, row = [], 0
    for seq, (context_len, num_new) in enumerate(zip(context_lens, query_lens)):
        keys = reference.gather_context(k_cache, tables[seq], context_len)
        values = reference.gather_context(v_cache, tables[seq], context_len)
        outputs.append(reference.causal_attention(query[row:row + num_new], keys, values, scale, window))
        row += num_new
    return torch.cat(outputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_attention_on_the_gpu_matches_the_reference(triton_paged, shape: str, dtype: torch.dtype, step: str) -> None:
    num_heads, num_kv_heads, head_dim, window = SHAPES[shape]
    k_cache, v_cache, tables = random_pool(CONTEXTS, num_kv_heads, head_dim, dtype)
    query_lens = [1] * len(CONTEXTS) if step == "decode" else [1, 17, 120, 700]
    query = torch.randn(sum(query_lens), num_heads, head_dim, device="cuda").to(dtype)
    scale = head_dim ** -0.5
    meta = triton_paged.prepare(tables, torch.tensor(CONTEXTS, dtype=torch.int32, device="cuda"),
                                torch.tensor(query_lens, dtype=torch.int32, device="cuda"), BLOCK_SIZE, window)
    out = triton_paged.attend(query, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.device.type == "cuda"
    assert_close(out, expected_outputs(query, k_cache, v_cache, tables, CONTEXTS, query_lens, scale, window))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["smollm2", "gemma3-4b"])
def test_store_kv_on_the_gpu_writes_each_token_to_its_slot_and_skips_padding(triton_paged, shape: str,
                                                                            dtype: torch.dtype) -> None:
    _, num_kv_heads, head_dim, _ = SHAPES[shape]
    k_cache, v_cache, _ = random_pool([64], num_kv_heads, head_dim, dtype)
    qkv = torch.randn(6, 3, num_kv_heads, head_dim, device="cuda")   # key/value as strided views of one qkv
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([17, -1, 3, 40, -1, 63], device="cuda")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    triton_paged.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# (K, N, stack width R) of a fused linear's LoRA: SmolLM2's q|k|v at rank 16, Llama 3 8B's gate|up at rank 64
LORA_SHAPES = {"smollm2-qkv": (576, 960, 48), "llama3-8b-gate-up": (4096, 28672, 128)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LORA_SHAPES)
@pytest.mark.parametrize("num_rows", [5, 300])
def test_triton_lora_matches_the_torch_reference_on_the_gpu(shape, dtype, num_rows):
    from kernels import torch_lora, triton_lora
    from kernels.torch_lora import LoraRows

    k, n, width = LORA_SHAPES[shape]
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_rows, k, generator=generator, device="cuda").to(dtype)
    a_stack = (torch.randn(4, width, k, generator=generator, device="cuda") / k ** 0.5).to(dtype)
    b_stack = (torch.randn(4, n, width, generator=generator, device="cuda") / width ** 0.5).to(dtype)
    row_slots = [(-1, 0, 2, 3, 2)[i % 5] for i in range(num_rows)]   # interleaved adapters and base rows
    rows = LoraRows.of(row_slots, torch.device("cuda"))
    base = torch.randn(num_rows, n, generator=generator, device="cuda").to(dtype)
    expected, got = base.clone(), base.clone()
    torch_lora.add_lora(expected, x, a_stack, b_stack, rows)
    triton_lora.add_lora(got, x, a_stack, b_stack, rows)
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOLERANCE[dtype] * 10, atol=TOLERANCE[dtype] * 10)
    assert torch.equal(got[0::5], base[0::5])   # base-model rows untouched
