"""Decode steps replayed from captured graphs give the tokens of eager steps. On the CPU the capture is
eager_capture (replay reruns the forward) and the Triton kernels are interpreted: everything but the CUDA calls
runs, the padded batches, the persistent buffers and the metadata built once over them included."""
from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from base.sampling_params import SamplingParams  # noqa: E402
from gpu_worker.cuda.cuda_graphs import DecodeGraphs, batch_sizes, eager_capture  # noqa: E402
from gpu_worker.cuda.device_memory import MemoryPlan, profile_blocks, profile_requests  # noqa: E402
from gpu_worker.kv_pool import KVPool  # noqa: E402
from gpu_worker.cuda.warm_up import compile_kernels  # noqa: E402
from tests.conftest import import_interpreted_kernels  # noqa: E402
from tests.engine_fixtures import BLOCK_SIZE, random_prompts, tiny_engine  # noqa: E402

import_interpreted_kernels()
GiB = 1 << 30


def test_batch_sizes_pad_to_buckets_up_to_the_largest_batch() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(5) == [1, 2, 4, 5]
    assert batch_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert batch_sizes(130)[-2:] == [128, 130]


def graphed(engine, max_batch: int) -> list[int]:
    """Give the engine's runner decode graphs (captured eagerly); returns the list each replay appends to."""
    runner = engine.worker.runner
    runner.graphs = DecodeGraphs(runner.model, runner.pool.layers, runner.backend, BLOCK_SIZE, max_batch,
                                 engine.info.max_model_len, runner.device, runner.lora)
    runner.graphs.capture_all(eager_capture)
    replays = []
    prepare = runner.graphs.prepare
    runner.graphs.prepare = lambda rows: replays.append(len(rows.input_ids)) or prepare(rows)
    return replays


def five_requests(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy, seeded top-p, and penalised with a logit bias: five decodes that fit a graph of 8."""
    prompts = random_prompts(seed=seed, count=5, lengths=range(3, 30))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={5: 2.0}, max_tokens=12, ignore_eos=True)]
    return prompts, params


def test_graph_decode_steps_give_the_tokens_of_eager_ones(tiny_llama_dir) -> None:
    prompts, params = five_requests(seed=3)
    outputs = {}
    for mode in ("eager", "graphs"):
        engine = tiny_engine(tiny_llama_dir, attention_backend="triton", max_num_batched_tokens=16)
        replays = graphed(engine, max_batch=8) if mode == "graphs" else []
        outputs[mode] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outputs["graphs"] == outputs["eager"]
    assert replays and 5 in replays            # the full batch of 5, padded to the graph of 8


def test_graph_decode_steps_launched_before_the_last_ones_tokens_are_back_give_the_tokens_of_eager_ones(
        tiny_llama_dir) -> None:
    """worker_overlap: a replayed step's input ids are the previous step's sampled ids, copied on the device into
    the graphs' buffer after the host's rows (which hold a placeholder there)."""
    from tests.engine.test_async_scheduling import run_overlapped, run_pipelined

    prompts, params = five_requests(seed=5)
    outputs = {}
    for mode in ("eager", "overlapped graphs"):
        engine = tiny_engine(tiny_llama_dir, attention_backend="triton", max_num_batched_tokens=16,
                             worker_overlap="on" if mode != "eager" else "off")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
        if mode == "eager":
            outputs[mode] = run_pipelined(engine.scheduler, engine.worker, depth=1)[0]
        else:
            replays = graphed(engine, max_batch=8)
            outputs[mode] = run_overlapped(engine.scheduler, engine.worker)[0]
    assert outputs["overlapped graphs"] == outputs["eager"]
    assert replays and 5 in replays


def test_graph_decode_steps_with_lora_match_peft_merged_models_with_adapters_and_base_rows_mixed(
        tiny_llama_dir, tmp_path, monkeypatch) -> None:
    """The graphs hold the adapters' products (Triton's kernels over fixed row buffers, as on a GPU): base rows and
    two adapters' rows interleaved in each replayed step, and each request's tokens are those of PEFT's merged model.
    Slot changes between steps reach the graphs, since they read the slots' weights where they lie."""
    from gpu_worker.lora import lora_slots
    from tests.conftest import transformers_greedy
    from tests.lora_fixtures import build_peft_adapter, merged_model

    triton_lora = import_interpreted_kernels("kernels.triton_lora")
    monkeypatch.setattr(lora_slots, "lora_kernel", lambda device: triton_lora.add_lora)
    adapters = {name: str(build_peft_adapter(tiny_llama_dir, tmp_path / name, rank, seed=rank))
                for name, rank in (("a4", 4), ("a8", 8))}
    prompts = random_prompts(seed=6, count=6, lengths=range(3, 20))
    names = ["a8", "", "a4", "a8", "", "a4"]
    expected = {name: transformers_greedy(merged_model(tiny_llama_dir, adapters.get(name)), prompts, 8)
                for name in ("", "a4", "a8")}
    engine = tiny_engine(tiny_llama_dir, attention_backend="triton", max_num_batched_tokens=16, enable_lora=True,
                         lora_modules=[f"{name}={path}" for name, path in adapters.items()], max_loras=2,
                         max_lora_rank=8)
    assert engine.worker.runner.lora.graphable
    replays = graphed(engine, max_batch=8)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              lora_names=names)
    assert [r.token_ids for r in results] == [expected[name][i] for i, name in enumerate(names)]
    assert replays and 6 in replays


def test_a_batch_larger_than_any_graph_runs_eagerly(tiny_llama_dir) -> None:
    engine = tiny_engine(tiny_llama_dir, attention_backend="triton")
    replays = graphed(engine, max_batch=2)
    prompts = random_prompts(seed=4, count=3, lengths=range(3, 9))
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(r.token_ids) == 4 for r in results)
    assert all(n <= 2 for n in replays)


def test_the_profiling_step_runs_over_a_pool_of_just_its_blocks(tiny_llama_dir) -> None:
    """The worker's memory profile on a GPU: the largest step the scheduler may send, through a runner."""
    engine = tiny_engine(tiny_llama_dir)
    request = profile_requests(num_tokens=70, num_seqs=8, max_model_len=64, block_size=BLOCK_SIZE)
    assert sum(len(s.token_ids) for s in request.new_seqs) == 70 and len(request.new_seqs) == 8
    runner = engine.worker.runner
    pool = KVPool.of_blocks(runner.model.shape, BLOCK_SIZE, profile_blocks(request), runner.pool.tensor.dtype,
                            runner.device)
    profiler = type(runner)(runner.model, pool, runner.backend, runner.device)
    result = profiler.step(request)
    assert len(result.sampled) == 8


def test_the_warm_up_prefills_every_tile_size_and_decodes_after_each_leaving_no_sequence(tiny_llama_dir) -> None:
    """What the worker runs on a GPU before it is ready, so that every Triton variant compiles then."""
    engine = tiny_engine(tiny_llama_dir, attention_backend="triton")
    runner, steps = engine.worker.runner, []
    step = runner.step
    runner.step = lambda request: steps.append(request) or step(request)
    compile_kernels(runner, max_num_batched_tokens=40, max_model_len=engine.info.max_model_len)
    prefills = [len(s.new_seqs[0].token_ids) for s in steps if s.new_seqs]
    assert prefills == [1, 2, 4, 8, 16, 32, 40]
    assert sum(1 for s in steps if s.cached_seqs) == len(prefills) and not runner.seqs
    assert engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].finish_reason


def test_a_model_that_leaves_no_room_for_its_kv_cache_is_refused_with_the_numbers() -> None:
    plan = MemoryPlan(total=80 * GiB, utilization=0.9, weights=60 * GiB, activation_peak=2 * GiB,
                      outside_torch=1 * GiB)
    assert plan.checked_kv_bytes(1 << 20) == int(0.9 * 80 * GiB) - 63 * GiB
    tight = MemoryPlan(total=80 * GiB, utilization=0.5, weights=60 * GiB, activation_peak=2 * GiB,
                       outside_torch=1 * GiB)
    with pytest.raises(ValueError, match=r"weights 60.00 GiB, activation peak 2.00 GiB.*left for the KV cache -23"):
        tight.checked_kv_bytes(1 << 20)
