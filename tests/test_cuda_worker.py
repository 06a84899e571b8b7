"""The worker on a GPU: the sampler on the device against the same sampler on the CPU, decode steps from CUDA
graphs against eager ones, loading's device memory, and a model too large for its memory budget refused with the
numbers. Skipped without CUDA (scripts/gpu_check.sh runs it); tests/test_decode_graphs.py and tests/test_loading.py
cover the same code on the CPU."""
from __future__ import annotations

import os

import pytest
import torch

from base.sampling_params import SamplingParams
from benchmarks.random_models import save_random_llama
from gpu_worker.sampler import SampleRow, sample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU and compiled (not interpreted) Triton kernels")

VOCAB = 1000
GiB = 1 << 30


def rows_of(params: list[SamplingParams], bitmask: bytes | None = None) -> list[SampleRow]:
    return [SampleRow(p, [1, 2, 3, 5, 5, 9], 3, 0, bitmask if i == 0 else None) for i, p in enumerate(params)]


def test_the_sampler_on_the_gpu_picks_what_it_picks_on_the_cpu_wherever_no_random_draw_decides() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    allowed = torch.zeros(VOCAB // 32, dtype=torch.int32)
    allowed[3] = 0b1010   # the grammar allows tokens 97 and 99 only
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0, logit_bias={7: 50.0}, logprobs=5),
              SamplingParams(temperature=0, min_tokens=10, stop_token_ids=[int(logits[3].argmax())]),
              SamplingParams(temperature=0.7, top_k=1)]
    rows = rows_of(params, allowed.numpy().tobytes())
    on_cpu = sample(logits.clone(), rows, torch.Generator().manual_seed(0), eos_token_ids=(2,))
    on_gpu = sample(logits.cuda(), rows, torch.Generator(device="cuda").manual_seed(0), eos_token_ids=(2,))
    assert on_gpu[0] == on_cpu[0] and on_cpu[0][0] in (97, 99) and on_cpu[0][2] == 7
    cpu_entry, gpu_entry = on_cpu[1][2], on_gpu[1][2]
    assert [t.token_id for t in gpu_entry.top] == [t.token_id for t in cpu_entry.top]
    assert gpu_entry.logprob == pytest.approx(cpu_entry.logprob, abs=1e-4)


def test_a_seeded_row_draws_the_same_token_on_the_gpu_whatever_else_is_in_the_batch() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).cuda()
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = sample(logits[:1].clone(), rows_of([seeded]), torch.Generator(device="cuda").manual_seed(0))[0]
    batched = sample(logits.clone(), rows_of([seeded] + [SamplingParams(temperature=1.0)] * 3),
                     torch.Generator(device="cuda").manual_seed(5))[0]
    assert alone[0] == batched[0]


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("tiny"), "tiny", torch.float32, weight_std=0.15)


def test_decode_steps_from_cuda_graphs_give_the_tokens_of_eager_steps(tiny_fp32) -> None:
    from ferry import Engine, EngineConfig
    prompts = [[5 + i, 17, 99, 3, 250 - i, 41][: 2 + i % 5] * (1 + i % 3) for i in range(11)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_fp32), dtype="float32", device="cuda", kv_cache_memory=GiB // 8,
                                     max_num_seqs=16, enforce_eager=eager))
        assert (engine.worker.runner.graphs is None) == eager
        outputs[eager] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outputs[False] == outputs[True]


@pytest.fixture(scope="module")
def mid_fp32(tmp_path_factory):
    """169M parameters, 675 MB in fp32, the largest tensor 131 MB."""
    return save_random_llama(tmp_path_factory.mktemp("mid"), "tiny", torch.float32, hidden_size=1024,
                             intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=4, head_dim=64, vocab_size=32000)


def test_loading_in_bf16_takes_the_bf16_model_and_one_tensor_in_flight_of_device_memory(mid_fp32) -> None:
    from transformers import AutoConfig

    from gpu_worker.models import model_class
    from gpu_worker.worker import Worker
    config = AutoConfig.from_pretrained(mid_fp32)
    family = model_class(config.model_type)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = Worker.load_model(family, family.shape_from_config(config), config, 256, mid_fp32, torch.bfloat16,
                              torch.device("cuda"), None)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_fp32 = 32000 * 1024 * 4
    assert torch.cuda.max_memory_allocated() - before <= model_bytes + 2 * largest_fp32 + (16 << 20)


def test_a_memory_budget_smaller_than_the_weights_is_refused_with_the_numbers(mid_fp32) -> None:
    from ferry import Engine, EngineConfig
    with pytest.raises(ValueError, match="does not fit.*weights"):
        Engine(EngineConfig(model=str(mid_fp32), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.001))
