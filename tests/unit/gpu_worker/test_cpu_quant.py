"""Linears multiplied from a GGUF file's Q4_1 / Q8_0 blocks: the same weights as gguf's dequantize, bit for bit, the
same products, and the default model decoding from its own file's blocks token-exact against transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_quant

pytestmark = pytest.mark.skipif(cpu_quant.extension() is None, reason="no C++ compiler for the CPU kernels")
PATHS = pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])   # the machine's vector path


def random_blocks(kind: str, rows: int, in_features: int, seed: int) -> np.ndarray:
    """GGUF blocks with random quants and scales (and mins) of either sign, as a file stores them."""
    rng = np.random.default_rng(seed)
    num_blocks = in_features // cpu_quant.BLOCK
    blocks = rng.integers(0, 256, size=(rows, num_blocks, cpu_quant.BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = 2 if kind == "Q4_1" else 1
    scales = rng.normal(0, 0.05, size=(rows, num_blocks, halves)).astype(np.float16)
    blocks[:, :, :2 * halves] = scales.view(np.uint8).reshape(rows, num_blocks, 2 * halves)
    return blocks


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_packed_blocks_widen_to_ggufs_dequantized_weight_bit_for_bit(kind):
    import gguf

    blocks = random_blocks(kind, 48, 96, seed=1)
    expected = gguf.dequantize(blocks.reshape(48, -1), gguf.GGMLQuantizationType[kind])
    assert torch.equal(cpu_quant.widened(cpu_quant.pack(kind, blocks)), torch.from_numpy(expected))


@PATHS
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])   # a block of four rows, the rest, several blocks
def test_a_quantized_linear_multiplies_the_widened_weight(portable, kind, rows):
    weight = cpu_quant.pack(kind, random_blocks(kind, 32, 128, seed=rows))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    module = cpu_quant.extension(portable)
    out = module.quantized_linear(x, weight.scales, weight.mins, weight.quants)
    torch.testing.assert_close(out, x @ cpu_quant.widened(weight).T, atol=1e-4, rtol=1e-5)


def summed_in_k_order(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """x @ weight.T with each output's products added over k in order from 0, as the kernel adds them. Fused: each
    product and sum rounded once, as an FMA does (float64 holds the product of two fp32 exactly; the one rounding
    of the sum to float64 before fp32 could differ from an FMA's in a rare tie, which these seeds do not meet)."""
    total = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        if fused:
            total = (x[:, k, None].double() * weight[:, k].double() + total.double()).float()
        else:
            total = total + x[:, k, None] * weight[:, k]
    return total


@PATHS
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
# up to 4 rows: widened in registers (1, 2, 4); more: in a buffer, in blocks of 5-6 (5, 17, 32) or not (7, 8, 13)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 8, 13, 17, 32])
def test_each_row_sums_the_widened_weight_in_k_order_bit_for_bit(portable, kind, rows):
    """At any batch the same bits as one row alone: the buffered path, its k in chunks of 128 (here two and a
    half), carries each sum across chunks instead of adding chunks' sums."""
    weight = cpu_quant.pack(kind, random_blocks(kind, 48, 320, seed=rows))
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
    module = cpu_quant.extension(portable)
    out = module.quantized_linear(x, weight.scales, weight.mins, weight.quants)
    expected = summed_in_k_order(x, cpu_quant.widened(weight), module.fused_multiply_add())
    assert torch.equal(out, expected)


def test_blocks_of_the_wrong_shape_are_refused():
    weight = cpu_quant.pack("Q4_1", random_blocks("Q4_1", 16, 64, seed=0))
    with pytest.raises(RuntimeError, match="mins"):
        cpu_quant.extension().quantized_linear(torch.randn(2, 64), weight.scales, torch.empty(0), weight.quants)


@pytest.mark.slow
def test_the_default_model_decodes_from_its_gguf_blocks_token_exact_against_transformers(tmp_path, monkeypatch):
    """On the first start from the file's blocks, on the second from the cache they were written to."""
    from transformers import AutoModelForCausalLM

    from ferry import Engine, EngineConfig, SamplingParams
    from gpu_worker.cpu import quantized_linears
    from gpu_worker.loading.model_files import default_model_dir
    from tests.conftest import transformers_greedy

    monkeypatch.setattr(quantized_linears, "gguf_blocks_dir", lambda gguf_file: tmp_path / "blocks")
    file_reads, parse = [], quantized_linears.GgufRows
    monkeypatch.setattr(quantized_linears, "GgufRows", lambda path: file_reads.append(path) or parse(path))
    reference = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    for _ in ("first start", "second start"):
        engine = Engine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=1 << 27))
        model = engine.worker.runner.model
        num_layers = len(model.layers)
        quantized = sum(isinstance(m, quantized_linears.QuantizedLinear) for m in model.modules())
        assert quantized == 4 * num_layers + 1   # and the LM head
        prompts = [engine.tokenizer.encode(text) for text in
                   ("The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,")]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outputs = [r.token_ids for r in engine.generate(prompts, params)]   # four rows a step: the blocks' path
        assert outputs == transformers_greedy(reference, prompts, 12)
    assert len(file_reads) == 1
