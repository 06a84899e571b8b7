"""The mixture of experts without a host sync (torch._grouped_mm, group ends on the device) computes what one
linear per expert computes, and reads nothing back to the host on its way. On a GPU (scripts/gpu_check.sh runs this
file) the comparison runs there too."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.model import TorchLayerOps
from gpu_worker.models.moe import MoeShape, SparseMoe, grouped_mm_works

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def sparse_moe(top_k: int, dtype: torch.dtype, device: str = "cpu") -> SparseMoe:
    shape = MoeShape(vocab_size=64, hidden_size=32, intermediate_size=0, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                     max_position_embeddings=64, num_experts=8, num_experts_per_tok=top_k,
                     moe_intermediate_size=24, sparse_layers=(True,))
    torch.manual_seed(top_k)
    moe = SparseMoe(shape)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return moe.to(dtype=dtype, device=device)


@pytest.fixture
def no_host_reads(monkeypatch):
    """Any read of a tensor's values back to the host fails the test (on a GPU each would be a sync)."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("the grouped path read a tensor back to the host")
    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("top_k, tokens", [(2, 9), (1, 5), (3, 1)])   # some experts get no token
def test_grouped_gemms_compute_what_one_linear_per_expert_computes(device, dtype, tolerance, top_k, tokens):
    moe = sparse_moe(top_k, dtype, device)
    if not grouped_mm_works(torch.device(device), dtype, moe.experts_down.shape):
        pytest.skip(f"this torch has no grouped GEMM for {dtype} on {device}: the per-expert path runs there")
    hidden = torch.randn(tokens, 32, dtype=dtype, device=device)
    with torch.no_grad():
        weights, experts = moe.route(hidden)
        expected = moe.run_per_expert(hidden, weights, experts, TorchLayerOps)
        got = moe.run_grouped_mm(hidden, weights, experts, TorchLayerOps)
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_the_grouped_path_reads_nothing_back_to_the_host(no_host_reads):
    moe = sparse_moe(2, torch.float32)
    hidden = torch.randn(6, 32)
    with torch.no_grad():
        weights, experts = moe.route(hidden)
        assert moe.run_grouped_mm(hidden, weights, experts, TorchLayerOps).shape == (6, 2, 32)


def test_an_unpacked_moe_takes_the_grouped_path_where_torch_has_it(monkeypatch):
    moe = sparse_moe(2, torch.float32)
    assert grouped_mm_works(torch.device("cpu"), torch.float32, moe.experts_down.shape)
    monkeypatch.setattr(SparseMoe, "run_per_expert", lambda *args: pytest.fail("the per-expert path ran"))
    with torch.no_grad():
        assert moe(torch.randn(4, 32), TorchLayerOps).shape == (4, 32)


def test_widths_its_kernels_cannot_align_fall_back_to_one_linear_per_expert():
    assert not grouped_mm_works(torch.device("cpu"), torch.bfloat16, torch.Size([4, 30, 20]))
