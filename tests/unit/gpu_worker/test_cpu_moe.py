"""The C++ mixture-of-experts kernel (all experts in one call) computes what one torch linear per expert computes."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.model import TorchLayerOps
from gpu_worker.models.moe import MoeShape, SparseMoe
from kernels import cpu_moe, torch_paged

pytestmark = pytest.mark.skipif(cpu_moe.extension() is None, reason="no C++ compiler for the CPU kernels")
PATHS = pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])   # the machine's vector path


def per_expert_reference(x: torch.Tensor, counts: list[int], weights: torch.Tensor) -> torch.Tensor:
    starts = torch.tensor([0, *counts]).cumsum(0).tolist()
    return torch.cat([x[starts[e]:starts[e + 1]] @ weights[e].T for e in range(len(counts))])


@PATHS
@pytest.mark.parametrize("counts", [[3, 0, 9, 1, 4, 7, 2, 6], [0, 0, 1, 0], [5]])   # empty experts, 1..9 rows each
def test_grouped_linear_matches_one_matmul_per_expert(portable, counts):
    torch.manual_seed(len(counts))
    weights = torch.randn(len(counts), 48, 40)
    x = torch.randn(sum(counts), 40)
    module = cpu_moe.extension(portable)
    out = module.grouped_linear(x, torch.tensor(counts), cpu_moe.pack(weights))
    torch.testing.assert_close(out, per_expert_reference(x, counts, weights), atol=1e-4, rtol=1e-5)


@PATHS
def test_rows_are_gathered_scaled_and_scattered_to_each_tokens_slots_in_expert_order(portable):
    torch.manual_seed(1)
    tokens, k, num_experts, width = 7, 3, 5, 32
    experts = torch.stack([torch.randperm(num_experts)[:k] for _ in range(tokens)])
    routing = torch.rand(tokens, k)
    weights, x = torch.randn(num_experts, 16, width), torch.randn(tokens, width)
    module = cpu_moe.extension(portable)
    source, scale, destination, counts = module.group_by_expert(experts, routing, num_experts)
    out = module.grouped_linear(x, counts, cpu_moe.pack(weights), source=source, scale=scale,
                                destination=destination).view(tokens, k, 16)
    for token in range(tokens):
        ascending, slots = experts[token].sort()
        expected = torch.stack([x[token] @ weights[e].T * routing[token, slot] for e, slot in zip(ascending, slots)])
        torch.testing.assert_close(out[token], expected, atol=1e-4, rtol=1e-5)


def test_an_expert_index_out_of_range_is_refused():
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_moe.extension().group_by_expert(torch.tensor([[0, 9]]), torch.rand(1, 2), 4)


def sparse_moe(top_k: int) -> SparseMoe:
    shape = MoeShape(vocab_size=64, hidden_size=32, intermediate_size=0, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                     max_position_embeddings=64, num_experts=6, num_experts_per_tok=top_k,
                     moe_intermediate_size=24, sparse_layers=(True,))
    moe = SparseMoe(shape)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return moe


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_a_sparse_moe_layer_gives_the_same_output_through_the_kernel_as_through_torch(top_k):
    torch.manual_seed(top_k)
    moe = sparse_moe(top_k)
    hidden = torch.randn(33, 32)
    ops = TorchLayerOps(torch_paged.store_kv)
    with torch.no_grad():
        reference = moe(hidden, ops)
        moe.pack_experts()
        assert moe.cpu_kernel is not None
        torch.testing.assert_close(moe(hidden, ops), reference, atol=1e-5, rtol=1e-5)
