"""The fused C++ layer ops on the CPU compute what the torch ops they replace compute."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.model import TorchLayerOps
from kernels import cpu_layers, torch_paged

pytestmark = pytest.mark.skipif(cpu_layers.extension() is None, reason="no C++ compiler for the CPU kernels")
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 9, 3, 64, 576, 1536


PATHS = pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])   # the machine's vector path


@pytest.fixture(params=[False, True], ids=["simd", "portable"])
def ops(request):
    return cpu_layers.layer_ops(portable=request.param), TorchLayerOps(torch_paged.store_kv)


def assert_matches(fused: torch.Tensor, reference: torch.Tensor) -> None:
    """bf16: the same roundings, so equal but for an ulp where the exponentials differ; fp32: equal to an ulp."""
    if fused.dtype == torch.bfloat16:
        assert (fused == reference).float().mean() > 0.98
        torch.testing.assert_close(fused, reference, atol=0, rtol=2 ** -6)   # two roundings: 2 ulps
    else:
        torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("width", [7, 12, HIDDEN, 4100])   # shorter than a vector, 8-16, a model's, cascaded sums
def test_rms_norm_and_residual_add_are_bit_identical(ops, dtype, rows, width):
    """An ulp off in the RMS sum flips bf16 roundings, and over 30 layers SmolLM2's greedy answer changed.

    fp32 from width 12 up shows the summation order. Run with torch 2.13 on an Intel Xeon Sapphire Rapids (AVX-512
    with BF16 and FP16, AMX; torch reports AVX512), as it is and with ATEN_CPU_CAPABILITY=avx2 and =default; the
    same 8-lane order passed before on AMD EPYC Zen 3 (AVX2). Not rerun on an AVX-512 AMD EPYC (Zen 5)."""
    fused, reference = ops
    torch.manual_seed(rows)
    x = torch.randn(rows, width, dtype=dtype) * torch.rand(rows, 1, dtype=dtype) * 30
    weight = (torch.rand(width) + 0.5).to(dtype)
    assert torch.equal(fused.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    residual = torch.randn(rows, width, dtype=dtype)
    residual_ref = residual.clone()
    out = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, residual_ref + x)   # the residual stream is updated in place, rounded as eager
    assert torch.equal(out, reference.add_rms_norm(x, residual_ref, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(ops, dtype):
    fused, reference = ops
    gate_up = torch.randn(23, 2 * INTERMEDIATE, dtype=dtype) * 5
    gate_up[0, :9] = torch.tensor([-200.0, -90.0, -50.0, -0.0, 0.0, 50.0, 90.0, 200.0, 1e-30])   # exp's far ends
    assert_matches(fused.silu_mul(gate_up), reference.silu_mul(gate_up))


def empty_pool(layout: str, dtype: torch.dtype) -> torch.Tensor:
    """[12 blocks, 4 tokens, KV, D]: token-major storage, or head-major (Ferry's pool) seen through a view."""
    if layout == "head_major":
        return torch.zeros(12, KV_HEADS, 4, HEAD_DIM, dtype=dtype).transpose(1, 2)
    return torch.zeros(12, 4, KV_HEADS, HEAD_DIM, dtype=dtype)


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 48], ids=["whole", "partial"])   # 48: Phi-4-mini's 3/4
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_kv_store_are_bit_identical_and_skip_shared_slots(ops, dtype, layout, rotary_dim):
    fused, reference = ops
    torch.manual_seed(1)
    rows = 29
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    cos, sin = torch.randn(rows, rotary_dim).to(dtype), torch.randn(rows, rotary_dim).to(dtype)
    pools = [empty_pool(layout, dtype) for _ in range(4)]
    slots = torch.randperm(48)[:rows]
    slots[[0, 5]] = -1                 # tokens already in a shared block: not stored
    q = fused.rotary_store_kv(qkv, cos, sin, pools[0], pools[1], slots, HEADS, KV_HEADS)
    q_ref = reference.rotary_store_kv(qkv, cos, sin, pools[2], pools[3], slots, HEADS, KV_HEADS)
    assert torch.equal(q, q_ref)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert torch.equal(q[..., rotary_dim:], qkv[:, :HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)[..., rotary_dim:])
    written = pools[0].abs().sum((2, 3)).flatten() != 0
    assert written.nonzero().flatten().tolist() == sorted(slots[slots >= 0].tolist())


def test_a_slot_outside_the_pool_is_an_error_not_a_write(ops):
    fused, _ = ops
    qkv = torch.randn(2, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    cos = sin = torch.ones(2, HEAD_DIM)
    pool = torch.zeros(2, 4, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="outside the pool"):
        fused.rotary_store_kv(qkv, cos, sin, pool, pool.clone(), torch.tensor([0, 8]), HEADS, KV_HEADS)


@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 15, 16, 17, 100, 49152])
def test_greedy_argmax_is_torchs(dtype, width, portable):
    """The first index on ties (also across vector lanes and the scalar tail), a NaN counts as the largest, a row of
    -inf gives 0."""
    torch.manual_seed(width)
    logits = (torch.randn(6, width) * 8).to(dtype)
    peak = logits.float().max() + 1
    logits[0, width // 2] = logits[0, width - 1] = peak            # tie: the earlier one
    logits[1, width - 1] = peak                                     # the maximum in the tail
    logits[2, min(3, width - 1)] = logits[2, min(19, width - 1)] = peak   # tie between lanes
    logits[3] = float("-inf")
    logits[4, width - 1], logits[4, 0] = float("nan"), peak
    logits[5, min(9, width - 1)] = logits[5, min(7, width - 1)] = peak   # the earlier index in the higher lane
    expected = logits.argmax(dim=-1)
    assert torch.equal(cpu_layers.extension(portable).argmax_rows(logits), expected)
    assert expected[3] == 0 and expected[4] == width - 1


def test_greedy_argmax_of_no_logits_is_an_error():
    with pytest.raises(RuntimeError, match="must not be empty"):
        cpu_layers.extension().argmax_rows(torch.empty(2, 0, dtype=torch.bfloat16))
