"""The C++ CPU decode kernel reads the paged pool in place and agrees with the reference."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode, reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def needs_extension():
    if cpu_decode.extension() is None:
        pytest.skip("no C++ compiler here: the torch path serves decodes")


def scattered_pool(context_lens, num_kv_heads, head_dim, dtype, generator, block_size=16, spare=7):
    """A pool with spare blocks holding garbage (NaN included) and shuffled block tables."""
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_seq) + 2
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    start = 0
    for seq, (count, length) in enumerate(zip(blocks_per_seq, context_lens)):
        tables[seq, :count] = order[start:start + count]
        start += count
        # the token slots past the context in the last block hold garbage the kernel must not read
        last, used = int(tables[seq, count - 1]), length - (count - 1) * block_size
        k_cache[last, used:] = float("nan")
        v_cache[last, used:] = float("nan")
    # spare blocks (not in any table) are garbage too
    for block in order[start:].tolist():
        k_cache[block] = float("nan")
        v_cache[block] = float("nan")
    return k_cache, v_cache, tables


def check(context_lens, num_kv_heads, group, head_dim, dtype, seed=0, portable=False, lens_dtype=torch.int32,
          block_size=16):
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = scattered_pool(context_lens, num_kv_heads, head_dim, dtype, generator, block_size)
    query = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    lens = torch.tensor(context_lens, dtype=lens_dtype)
    scale = head_dim ** -0.5
    out = cpu_decode.paged_decode(query, k_cache, v_cache, tables, lens, scale, portable=portable)
    expected = reference.paged_attention_decode(query, k_cache, v_cache, tables, lens, scale)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert out.dtype == dtype and out.shape == query.shape


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads, group", [(2, 1), (3, 3), (2, 4), (1, 7)])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40])
def test_decode_matches_reference_over_shuffled_blocks(dtype, num_kv_heads, group, head_dim, portable):
    context_lens = [1, 15, 16, 17, 100, 37, 513]
    check(context_lens, num_kv_heads, group, head_dim, dtype, seed=num_kv_heads * 10 + group, portable=portable)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_split_into_partitions(dtype, portable):
    # long contexts are cut into partitions merged at the end; very different lengths in one batch
    check([2048, 1, 3000, 511, 512, 1025, 4097, 64], 3, 3, 64, dtype, seed=5, portable=portable,
          lens_dtype=torch.int64)


@pytest.mark.parametrize("head_dim", [1, 16, 33, 256, 512])
def test_any_head_dim_up_to_512(head_dim):
    check([5, 40, 700], 2, 2, head_dim, torch.float32, seed=head_dim)


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    check([1, 7, 8, 9, 31, 33, 600], 3, 3, 64, torch.bfloat16, seed=block_size, block_size=block_size)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("window", [1, 6, 16, 37, 600, 5000])
def test_sliding_window_attends_to_the_last_tokens_and_reads_nothing_before_them(window, portable):
    context_lens = [1, 15, 17, 40, 100, 1500]
    generator = torch.Generator().manual_seed(window)
    k_cache, v_cache, tables = scattered_pool(context_lens, 2, 64, torch.float32, generator)
    query = torch.randn(len(context_lens), 6, 64, generator=generator)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    expected = reference.paged_attention_decode(query, k_cache, v_cache, tables, lens, 0.125, window=window)
    for seq, length in enumerate(context_lens):   # the tokens before each window turn to garbage
        for position in range(max(0, length - window)):
            block, offset = int(tables[seq, position // 16]), position % 16
            k_cache[block, offset] = float("nan")
            v_cache[block, offset] = float("nan")
    out = cpu_decode.paged_decode(query, k_cache, v_cache, tables, lens, 0.125, portable=portable, window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_single_sequence_and_large_scores():
    # one long sequence (split across threads) with peaked scores: the running max must rescale correctly
    generator = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = scattered_pool([3000], 3, 64, torch.float32, generator)
    query = 30 * torch.randn(1, 9, 64, generator=generator)
    lens = torch.tensor([3000], dtype=torch.int32)
    out = cpu_decode.paged_decode(query, k_cache, v_cache, tables, lens, 0.125)
    expected = reference.paged_attention_decode(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_query_dtype_and_table_dtype_conversions():
    # int64 tables and a non-contiguous query are accepted
    generator = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables = scattered_pool([20, 300], 3, 64, torch.bfloat16, generator)
    query = torch.randn(9, 2, 64, generator=generator).to(torch.bfloat16).transpose(0, 1)
    lens = torch.tensor([20, 300])
    out = cpu_decode.paged_decode(query, k_cache, v_cache, tables.long(), lens, 0.125)
    expected = reference.paged_attention_decode(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("num_kv_heads, group", [(3, 3), (2, 4), (1, 7)])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40])
def test_bf16_matches_fp32_math_on_the_same_values_to_one_rounding(head_dim, num_kv_heads, group, portable):
    """bf16 queries and keys (scored with vdpbf16ps where the CPU has it): exact products summed in fp32, so the
    only error left is the output's bf16 rounding."""
    generator = torch.Generator().manual_seed(head_dim + group)
    context_lens = [1, 15, 16, 17, 100, 700]
    k_cache, v_cache, tables = scattered_pool(context_lens, num_kv_heads, head_dim, torch.bfloat16, generator)
    query = (2 * torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=generator)).bfloat16()
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = cpu_decode.paged_decode(query, k_cache, v_cache, tables, lens, head_dim ** -0.5, portable=portable)
    expected = reference.paged_attention_decode(query.float(), k_cache.float(), v_cache.float(), tables, lens,
                                                head_dim ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=2 ** -8)
