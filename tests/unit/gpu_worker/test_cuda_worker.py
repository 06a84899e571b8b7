"""The worker on a GPU: decode steps from CUDA graphs against eager ones, loading's device memory, and a model too
large for its memory budget refused with the numbers. Skipped without CUDA (scripts/gpu_check.sh runs it);
tests/engine/test_decode_graphs.py and tests/deploy/test_loading.py cover the same code on the CPU, test_sampler.py
the sampler on the GPU too."""
from __future__ import annotations

import os

import pytest
import torch

from base.sampling_params import SamplingParams
from benchmarks.common.random_models import save_random_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU and compiled (not interpreted) Triton kernels")

GiB = 1 << 30


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


@pytest.mark.parametrize("eager", [True, False])
def test_steps_launched_before_the_last_ones_tokens_are_back_give_the_tokens_of_one_at_a_time(tiny_fp32, eager):
    """worker_overlap on the device it is for: seeded and penalised rows too; the next step's inputs are read from
    the sampled ids on the GPU."""
    from ferry import Engine, EngineConfig
    from tests.engine.test_async_scheduling import run_overlapped, run_pipelined

    prompts = [[5 + i, 17, 99, 3, 250 - i, 41][: 2 + i % 5] * (1 + i % 3) for i in range(11)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 8 + [
        SamplingParams(temperature=0.9, seed=4, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(7, 11, 13))]
    outputs = {}
    for overlap in ("off", "on"):
        engine = Engine(EngineConfig(model=str(tiny_fp32), dtype="float32", device="cuda", kv_cache_memory=GiB // 8,
                                     max_num_seqs=16, enforce_eager=eager, worker_overlap=overlap))
        assert engine.worker.overlaps == (overlap == "on")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
        run = run_overlapped if overlap == "on" else lambda s, w: run_pipelined(s, w, 2)
        outputs[overlap] = run(engine.scheduler, engine.worker)[:2]
    assert outputs["on"] == outputs["off"]


def test_lora_decode_steps_from_cuda_graphs_give_the_tokens_of_eager_steps(tiny_fp32, tmp_path) -> None:
    """Two adapters and the base model interleaved in each step: the graphs (captured with the adapters' products
    over fixed row buffers) against every step eager; and the adapters do change the tokens."""
    from transformers import AutoConfig

    from benchmarks.engine.lora import write_random_adapter
    from ferry import Engine, EngineConfig
    config = AutoConfig.from_pretrained(tiny_fp32)
    modules = [f"a{seed}={write_random_adapter(tmp_path / f'a{seed}', config, 8, seed)}" for seed in (1, 2)]
    prompts = [[5 + i, 17, 99, 3, 250 - i, 41][: 2 + i % 5] * (1 + i % 3) for i in range(11)]
    names = [("", "a1", "a2")[i % 3] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_fp32), dtype="float32", device="cuda", kv_cache_memory=GiB // 8,
                                     max_num_seqs=16, enforce_eager=eager, enable_lora=True, lora_modules=modules,
                                     max_loras=2, max_lora_rank=8))
        assert (engine.worker.runner.graphs is None) == eager
        outputs[eager] = [r.token_ids for r in engine.generate(prompts, params, lora_names=names)]
        base = [r.token_ids for r in engine.generate(prompts, params)]
    assert outputs[False] == outputs[True]
    assert sum(a != b for a, b in zip(outputs[False], base)) >= 4   # the adapted rows' tokens moved


@pytest.mark.parametrize("family", ["phi3_partial_rotary", "gemma3_text"])
def test_partial_rotary_and_gemma_3_decode_as_transformers_on_the_gpu(tmp_path, family) -> None:
    """The rotary's torch path (the GPU's) on a head that rotates only in part, and Gemma 3's layers with the
    decode graphs: fp32 greedy tokens equal to transformers' on the same GPU."""
    from benchmarks.engine.exactness import ferry_greedy, transformers_greedy
    from tests.model_families_fixtures import build_tiny_model
    model_dir, model = build_tiny_model(tmp_path, family)
    prompts = [[5 + i, 17, 99, 3, 250 - i, 41][: 2 + i % 5] * (1 + i % 3) for i in range(6)]
    expected = transformers_greedy(model.to("cuda"), prompts, 12)
    assert ferry_greedy(str(model_dir), torch.float32, "cuda", prompts, 12, kv_cache_memory=GiB // 8) == expected


def test_embeddings_beside_graphed_decodes_with_overlap_are_transformers_on_the_gpu(tmp_path) -> None:
    """Embedding requests (a one-token chunk after a cache hit is one too) never replay a decode graph, and their
    hidden state survives the overlapped steps: equal to transformers' on the same GPU."""
    from ferry import Engine, EngineConfig, SamplingParams
    from tests.model_families_fixtures import build_tiny_model
    model_dir, model = build_tiny_model(tmp_path, "qwen3")
    prompts = [[(7 * i + 13 * j) % 300 + 3 for j in range(17 + i % 3)] for i in range(6)]   # a block, 1-3 more
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", device="cuda", kv_cache_memory=GiB // 8))
    model = model.to("cuda")
    with torch.no_grad():
        hidden = [model.model(torch.tensor([p], device="cuda")).last_hidden_state[0, -1] for p in prompts]
    expected = [torch.nn.functional.normalize(h, dim=-1).cpu() for h in hidden]
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))   # cached, graphs warm
    embed = SamplingParams(max_tokens=1, temperature=0, return_embedding=True)
    for result, want in zip(engine.generate(prompts, embed), expected):
        assert torch.allclose(torch.tensor(result.embedding), want, atol=1e-4)


def test_overlap_is_the_default_on_a_gpu(tiny_fp32) -> None:
    from ferry import Engine, EngineConfig
    engine = Engine(EngineConfig(model=str(tiny_fp32), dtype="float32", device="cuda", kv_cache_memory=GiB // 8))
    assert engine.worker.overlaps


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
