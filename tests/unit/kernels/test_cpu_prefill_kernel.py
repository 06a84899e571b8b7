"""The C++ CPU prefill kernel: causal attention of prefill chunks read in place from a shuffled pool (garbage and
NaN everywhere it must not read) agrees with dense attention, for any tile, group, head_dim, dtype and window."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_prefill, torch_paged
from tests.unit.kernels.test_cpu_decode_kernel import scattered_pool

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def needs_extension():
    if cpu_prefill.extension() is None:
        pytest.skip("no vector path or no C++ compiler here: prefill chunks go to the decode kernel")


def dense_attention(query, k_cache, v_cache, table, context, scale, window):
    """One sequence's last query.shape[0] positions over its context, in float64 from the table's blocks (the NaN
    poisoning positions no query sees made 0 here, where masked scores would still multiply them)."""
    block_size = k_cache.shape[1]
    positions = torch.arange(context)
    keys = k_cache[table.long()[positions // block_size], positions % block_size].double().nan_to_num(0.0)
    values = v_cache[table.long()[positions // block_size], positions % block_size].double().nan_to_num(0.0)
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,chd->hqc", query.double(), keys) * scale
    query_positions = torch.arange(context - query.shape[0], context).unsqueeze(1)
    visible = positions.unsqueeze(0) <= query_positions
    if window:
        visible &= positions.unsqueeze(0) > query_positions - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqc,chd->qhd", probs, values)


def poison_before_windows(k_cache, v_cache, tables, contexts, query_lens, window):
    """NaN in every position no query may see: the scheduler may have freed those blocks."""
    block_size = k_cache.shape[1]
    for table, context, new in zip(tables, contexts, query_lens):
        for position in range(max(0, context - new - window + 1)):
            block = int(table[position // block_size])
            k_cache[block, position % block_size] = float("nan")
            v_cache[block, position % block_size] = float("nan")


def check(contexts, query_lens, num_kv_heads, group, head_dim, dtype, window=0, block_size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = scattered_pool(contexts, num_kv_heads, head_dim, dtype, generator, block_size)
    if window:
        poison_before_windows(k_cache, v_cache, tables, contexts, query_lens, window)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    meta = torch_paged.prepare(tables, torch.tensor(contexts, dtype=torch.int32),
                               torch.tensor(query_lens, dtype=torch.int32), block_size, window)
    assert meta.prefill is not None
    out = torch_paged.attend(query, k_cache, v_cache, meta, scale)
    starts = [sum(query_lens[:s]) for s in range(len(contexts))]
    expected = torch.cat([dense_attention(query[start:start + new], k_cache, v_cache, table, context, scale, window)
                          for start, new, table, context in zip(starts, query_lens, tables, contexts)])
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads, group", [(2, 1), (3, 3), (2, 4), (1, 7)])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 40])
def test_prefill_chunks_with_decodes_between_match_dense_attention(dtype, num_kv_heads, group, head_dim):
    # a whole prompt, a decode, a chunk after a cached prefix, tiles cut mid-block, a chunk longer than a tile
    contexts, query_lens = [37, 16, 300, 9, 130, 17], [37, 1, 113, 2, 130, 1]
    check(contexts, query_lens, num_kv_heads, group, head_dim, dtype, seed=num_kv_heads * 10 + group)


@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
def test_sliding_windows_read_nothing_before_them(window):
    check([37, 16, 300, 130], [37, 1, 113, 130], 3, 3, 64, torch.float32, window=window, seed=window)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size):
    check([1, 7, 33, 200], [1, 7, 20, 199], 2, 3, 64, torch.bfloat16, block_size=block_size, seed=block_size)


@pytest.mark.parametrize("head_dim", [1, 16, 33, 256])
def test_any_head_dim(head_dim):
    check([5, 40, 70], [5, 2, 70], 2, 2, head_dim, torch.float32, seed=head_dim)


def test_only_the_given_sequences_rows_are_written():
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = scattered_pool([20, 20], 1, 32, torch.float32, generator)
    query = torch.randn(10, 2, 32, generator=generator)
    out = torch.full_like(query, 7.0)
    cpu_prefill.paged_prefill(query, k_cache, v_cache, tables[1:], torch.tensor([4]), torch.tensor([6]),
                              torch.tensor([20]), 0.2, 0, out)
    assert (out[:4] == 7.0).all() and not (out[4:] == 7.0).any()


def test_a_query_longer_than_its_context_is_refused():
    generator = torch.Generator().manual_seed(4)
    k_cache, v_cache, tables = scattered_pool([8], 1, 32, torch.float32, generator)
    query = torch.randn(9, 1, 32, generator=generator)
    with pytest.raises(RuntimeError, match="query length"):
        cpu_prefill.paged_prefill(query, k_cache, v_cache, tables, torch.tensor([0]), torch.tensor([9]),
                                  torch.tensor([8]), 0.2, 0, torch.empty_like(query))


def test_a_context_past_its_block_table_is_refused():
    generator = torch.Generator().manual_seed(4)
    k_cache, v_cache, tables = scattered_pool([8], 1, 32, torch.float32, generator)   # 3 blocks of 16 a table
    query = torch.randn(4, 1, 32, generator=generator)
    with pytest.raises(RuntimeError, match="past its block table"):
        cpu_prefill.paged_prefill(query, k_cache, v_cache, tables, torch.tensor([0]), torch.tensor([4]),
                                  torch.tensor([49]), 0.2, 0, torch.empty_like(query))


def test_without_it_prefill_rows_go_to_the_decode_kernel_with_the_same_result(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    contexts, query_lens = [70, 12, 33], [70, 1, 20]
    k_cache, v_cache, tables = scattered_pool(contexts, 2, 64, torch.float32, generator)
    query = torch.randn(sum(query_lens), 6, 64, generator=generator)
    prepare = lambda: torch_paged.prepare(tables, torch.tensor(contexts), torch.tensor(query_lens), 16)  # noqa: E731
    with_kernel = torch_paged.attend(query, k_cache, v_cache, prepare(), 0.125)
    monkeypatch.setenv("FERRY_CPU_PREFILL_KERNEL", "0")
    assert cpu_prefill.extension.__wrapped__() is None
    monkeypatch.setattr(cpu_prefill, "extension", lambda: None)
    meta = prepare()
    assert meta.prefill is None and meta.block_tables.shape[0] == sum(query_lens)
    torch.testing.assert_close(torch_paged.attend(query, k_cache, v_cache, meta, 0.125), with_kernel,
                               atol=2e-5, rtol=2e-5)
