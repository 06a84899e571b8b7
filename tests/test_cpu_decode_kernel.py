"""The C++ CPU decode kernel reads the paged pool in place and agrees with the reference."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, group", [(2, 1), (1, 3), (2, 4)])
def test_decode_matches_reference_over_shuffled_blocks(dtype, num_kv_heads, group):
    if cpu_decode.extension() is None:
        pytest.skip("no C++ compiler here: the torch path serves decodes")
    generator = torch.Generator().manual_seed(num_kv_heads * 10 + group)
    num_blocks, block_size, head_dim = 40, 16, 32
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    context_lens = torch.tensor([1, 15, 16, 17, 100], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:8] for _ in context_lens]).int()
    query = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    out = cpu_decode.paged_decode(query, k_cache, v_cache, tables, context_lens, head_dim ** -0.5)
    expected = reference.paged_attention_decode(query, k_cache, v_cache, tables, context_lens, head_dim ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert out.dtype == dtype
