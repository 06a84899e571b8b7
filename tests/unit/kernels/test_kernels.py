"""Paged attention kernels against the torch reference and dense causal attention, on CPU.

The Triton kernels run in Triton's interpreter. TRITON_INTERPRET must be set before triton itself is imported
(triton.language's own jit helpers are built at import), so if anything in this process imported triton
earlier, triton and the kernel module are imported afresh.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from kernels import cpu_decode, reference, torch_paged  # noqa: E402
from tests.conftest import import_interpreted_kernels  # noqa: E402

triton_paged = import_interpreted_kernels()

BACKENDS = {"triton": triton_paged, "torch": torch_paged, "torch-without-cpp": torch_paged}


@pytest.fixture(autouse=True)
def torch_without_cpp_kernels(request, monkeypatch):
    """The torch backend's own paths, taken where the C++ CPU kernels cannot be built."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "torch-without-cpp":
        monkeypatch.setattr(cpu_decode, "extension", lambda: None)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
HEAD_DIM = 32
BLOCK_SIZE = 8


@dataclass
class PagedBatch:
    """Sequences scattered over a shuffled pool, with their dense K/V and queries kept for the dense check."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    keys: list[torch.Tensor]      # per sequence [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]   # per sequence [context_len, num_heads, head_dim]


def make_batch(context_lens: list[int], num_heads: int, num_kv_heads: int, dtype: torch.dtype,
               seed: int = 0, layout: str = "token_major") -> PagedBatch:
    """layout "head_major": the pool stored [blocks, KV, block_size, D] and seen through a transposed view, as the
    worker's KVPool lays it out; "token_major": a contiguous [blocks, block_size, KV, D] tensor."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // BLOCK_SIZE) for length in context_lens]
    max_blocks = max(blocks_per_seq) + 1                       # a spare column: tables wider than needed
    num_blocks = sum(blocks_per_seq) + 5                       # spare blocks hold garbage
    pool_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(pool_shape, generator=generator).to(dtype) * 50  # garbage must never be read
    v_cache = torch.randn(pool_shape, generator=generator).to(dtype) * 50
    if layout == "head_major":
        k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()  # fragmented, shuffled
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    keys, values, queries = [], [], []
    for seq, length in enumerate(context_lens):
        table = [free_blocks.pop() for _ in range(blocks_per_seq[seq])]
        block_tables[seq, :len(table)] = torch.tensor(table, dtype=torch.int32)
        keys.append(torch.randn(length, num_kv_heads, HEAD_DIM, generator=generator).to(dtype))
        values.append(torch.randn(length, num_kv_heads, HEAD_DIM, generator=generator).to(dtype))
        queries.append(torch.randn(length, num_heads, HEAD_DIM, generator=generator).to(dtype))
        reference.store_kv(keys[-1], values[-1], k_cache, v_cache, slots_of(block_tables[seq], range(length)))
    return PagedBatch(k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32),
                      keys, values, queries)


def slots_of(block_table: torch.Tensor, positions: range) -> torch.Tensor:
    return torch.tensor([int(block_table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions],
                        dtype=torch.int64)


def dense_causal(batch: PagedBatch, seq: int, num_new: int, scale: float) -> torch.Tensor:
    """SDPA over the sequence's contiguous K/V: the last num_new positions' outputs."""
    q = batch.queries[seq].float().transpose(0, 1)
    k = batch.keys[seq].float().transpose(0, 1)
    v = batch.values[seq].float().transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out.transpose(0, 1)[-num_new:]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_each_token_to_its_slot_and_skips_padding(backend: str, dtype: torch.dtype,
                                                                  layout: str) -> None:
    batch = make_batch([13], num_heads=4, num_kv_heads=2, dtype=dtype, layout=layout)
    qkv = torch.randn(5, 3, 2, HEAD_DIM)                      # key/value as strided views, as a model makes them
    key, value = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.tensor([17, -1, 3, 40, -1])
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    BACKENDS[backend].store_kv(key, value, batch.k_cache, batch.v_cache, slot_mapping)
    assert torch.equal(batch.k_cache, expected_k) and torch.equal(batch.v_cache, expected_v)
    assert torch.equal(batch.k_cache[40 // BLOCK_SIZE, 40 % BLOCK_SIZE], key[3].to(dtype))


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_decode_matches_reference_and_dense_attention(backend: str, dtype: torch.dtype, num_heads: int,
                                                      num_kv_heads: int, layout: str) -> None:
    context_lens = [1, 19, 8, 30]
    batch = make_batch(context_lens, num_heads, num_kv_heads, dtype, layout=layout)
    query = torch.stack([q[-1] for q in batch.queries])
    scale = HEAD_DIM ** -0.5
    out = BACKENDS[backend].paged_attention_decode(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                                   batch.context_lens, scale)
    expected = reference.paged_attention_decode(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                                batch.context_lens, scale)
    assert_close(out, expected, dtype)
    dense = torch.cat([dense_causal(batch, seq, 1, scale) for seq in range(len(context_lens))])
    assert_close(out, dense, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_long_context_split_into_partitions_matches_one_pass(dtype: torch.dtype) -> None:
    context_lens = [301, 5, 128]                 # 5 partitions of 64; the short ones leave partitions empty
    batch = make_batch(context_lens, num_heads=3, num_kv_heads=1, dtype=dtype, seed=1)
    query = torch.stack([q[-1] for q in batch.queries])
    args = (query, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.3)
    partitioned = triton_paged.paged_attention_decode(*args, partition_size=64)
    one_pass = triton_paged.paged_attention_decode(*args, partition_size=512)
    exact_partitions = triton_paged.paged_attention_decode(*args, partition_size=64, max_context_len=301)
    expected = reference.paged_attention_decode(*args)
    assert_close(partitioned, expected, dtype)
    assert_close(one_pass, expected, dtype)
    assert_close(exact_partitions, expected, dtype)
    dense = torch.cat([dense_causal(batch, seq, 1, 0.3) for seq in range(len(context_lens))])
    assert_close(partitioned, dense, dtype)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_prefill_over_cached_prefix_matches_reference_and_dense(backend: str, dtype: torch.dtype,
                                                                num_heads: int, num_kv_heads: int, layout: str) -> None:
    context_lens = [21, 9, 40, 6]
    new_tokens = [21, 4, 19, 1]                  # a whole prompt, prefix hits / later chunks, a decode
    batch = make_batch(context_lens, num_heads, num_kv_heads, dtype, seed=2, layout=layout)
    query = torch.cat([q[-n:] for q, n in zip(batch.queries, new_tokens)])
    cu_seqlens_q = torch.tensor([0] + new_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = HEAD_DIM ** -0.5
    args = (query, batch.k_cache, batch.v_cache, batch.block_tables, cu_seqlens_q, batch.context_lens, scale)
    out = BACKENDS[backend].paged_prefill_attention(*args)
    assert_close(out, reference.paged_prefill_attention(*args), dtype)
    dense = torch.cat([dense_causal(batch, seq, n, scale) for seq, n in enumerate(new_tokens)])
    assert_close(out, dense, dtype)


def test_chunked_prefill_then_decode_equals_dense_attention_over_the_prompt() -> None:
    """The model's order of calls: store a chunk's K/V, attend; next chunk; then a decode step."""
    prompt_len, chunks = 27, [11, 10, 6]
    batch = make_batch([prompt_len + 1], num_heads=4, num_kv_heads=1, dtype=torch.float32, seed=3)
    k_cache, v_cache = torch.zeros_like(batch.k_cache), torch.zeros_like(batch.v_cache)
    table, scale, done, outputs = batch.block_tables, HEAD_DIM ** -0.5, 0, []
    for length in chunks + [1]:
        positions = range(done, done + length)
        triton_paged.store_kv(batch.keys[0][done:done + length], batch.values[0][done:done + length],
                              k_cache, v_cache, slots_of(table[0], positions))
        context = torch.tensor([done + length], dtype=torch.int32)
        query = batch.queries[0][done:done + length]
        if length == 1:
            outputs.append(triton_paged.paged_attention_decode(query, k_cache, v_cache, table, context, scale))
        else:
            cu_seqlens_q = torch.tensor([0, length], dtype=torch.int32)
            outputs.append(triton_paged.paged_prefill_attention(query, k_cache, v_cache, table, cu_seqlens_q,
                                                                context, scale))
        done += length
    assert_close(torch.cat(outputs), dense_causal(batch, 0, prompt_len + 1, scale), torch.float32)


@pytest.mark.parametrize("new_tokens", [[1, 1, 1], [5, 1, 12]])
def test_prepare_and_attend_agree_across_backends(new_tokens: list[int]) -> None:
    """The per-step interface the model runner uses: prepare once, attend in every layer."""
    context_lens = [14, 3, 25]
    batch = make_batch(context_lens, num_heads=6, num_kv_heads=2, dtype=torch.float32, seed=4)
    query = torch.cat([q[-n:] for q, n in zip(batch.queries, new_tokens)])
    query_lens = torch.tensor(new_tokens, dtype=torch.int32)
    outputs = []
    for backend in BACKENDS.values():
        meta = backend.prepare(batch.block_tables, batch.context_lens, query_lens, BLOCK_SIZE)
        outputs.append(backend.attend(query, batch.k_cache, batch.v_cache, meta, 0.2))
    dense = torch.cat([dense_causal(batch, seq, n, 0.2) for seq, n in enumerate(new_tokens)])
    for out in outputs:
        assert_close(out, dense, torch.float32)


def dense_windowed(batch: PagedBatch, seq: int, num_new: int, scale: float, window: int,
                   softcap: float) -> torch.Tensor:
    """The last num_new positions' outputs, each seeing its last `window` positions, scores softcapped (0: not)."""
    q = batch.queries[seq].float().transpose(0, 1)[:, -num_new:]
    group = q.shape[0] // batch.keys[seq].shape[1]
    k = batch.keys[seq].float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = batch.values[seq].float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query_positions = torch.arange(k.shape[1] - num_new, k.shape[1]).unsqueeze(1)
    positions = torch.arange(k.shape[1]).unsqueeze(0)
    visible = (positions <= query_positions) & (positions > query_positions - window)
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("path", ["kernel", "masks", "masks-softcapped", "without-cpp"])
@pytest.mark.parametrize("new_tokens", [[1, 1, 1], [5, 1, 12]])
def test_sliding_window_on_the_torch_backend_matches_a_dense_reference(new_tokens: list[int], path: str,
                                                                       monkeypatch) -> None:
    """Every path of the torch backend, with NaN in the blocks wholly before the windows: none reads them."""
    if path == "without-cpp":
        monkeypatch.setattr(cpu_decode, "extension", lambda: None)
    context_lens, window = [14, 3, 25], 6
    batch = make_batch(context_lens, num_heads=6, num_kv_heads=2, dtype=torch.float32, seed=5)
    poison_blocks_before_windows(batch, new_tokens, window)
    query = torch.cat([q[-n:] for q, n in zip(batch.queries, new_tokens)])
    query_lens = torch.tensor(new_tokens, dtype=torch.int32)
    softcap = 1.5 if path == "masks-softcapped" else 0.0
    meta = torch_paged.prepare(batch.block_tables, batch.context_lens, query_lens, BLOCK_SIZE, window,
                               masked=path.startswith("masks"))
    out = torch_paged.attend(query, batch.k_cache, batch.v_cache, meta, 0.2, softcap)
    expected = torch.cat([dense_windowed(batch, seq, n, 0.2, window, softcap) for seq, n in enumerate(new_tokens)])
    assert_close(out, expected, torch.float32)


def poison_blocks_before_windows(batch: PagedBatch, new_tokens: list[int], window: int) -> None:
    """NaN in every block wholly before the window of a sequence's first new token: what a freed block may hold
    once the pool reuses it. A kernel that reads one (even masked) turns the output NaN."""
    for seq, (context_len, num_new) in enumerate(zip(batch.context_lens.tolist(), new_tokens)):
        first_visible = context_len - num_new - window + 1
        for index in range(max(0, first_visible) // BLOCK_SIZE):
            block = int(batch.block_tables[seq, index])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens", [[1, 1, 1, 1], [5, 1, 12, 30]])
@pytest.mark.parametrize("window", [0, 6, 16])
def test_triton_sliding_window_matches_torch_and_never_reads_blocks_before_it(new_tokens: list[int], window: int,
                                                                               dtype: torch.dtype) -> None:
    context_lens = [14, 3, 25, 70]
    batch = make_batch(context_lens, num_heads=6, num_kv_heads=2, dtype=dtype, seed=6)
    if window:
        poison_blocks_before_windows(batch, new_tokens, window)
    query = torch.cat([q[-n:] for q, n in zip(batch.queries, new_tokens)])
    query_lens = torch.tensor(new_tokens, dtype=torch.int32)
    meta = triton_paged.prepare(batch.block_tables, batch.context_lens, query_lens, BLOCK_SIZE, window)
    out = triton_paged.attend(query, batch.k_cache, batch.v_cache, meta, 0.2)
    expected = torch.cat([dense_windowed(batch, seq, n, 0.2, window or 10**6, 0.0)
                          for seq, n in enumerate(new_tokens)])
    assert_close(out, expected, dtype)
    torch_meta = torch_paged.prepare(batch.block_tables, batch.context_lens, query_lens, BLOCK_SIZE, window)
    assert_close(out, torch_paged.attend(query, batch.k_cache, batch.v_cache, torch_meta, 0.2), dtype)


def test_triton_decode_with_a_window_leaves_partitions_before_it_empty() -> None:
    batch = make_batch([301, 5, 128], num_heads=3, num_kv_heads=1, dtype=torch.float32, seed=7)
    poison_blocks_before_windows(batch, [1, 1, 1], window=40)
    query = torch.stack([q[-1] for q in batch.queries])
    out = triton_paged.paged_attention_decode(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                              batch.context_lens, 0.3, partition_size=64, window=40)
    expected = torch.cat([dense_windowed(batch, seq, 1, 0.3, 40, 0.0) for seq in range(3)])
    assert_close(out, expected, torch.float32)
