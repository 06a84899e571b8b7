"""Async scheduling: the next step is built while the previous one runs (the scheduler service's engine loop). Its
outputs are those of one step at a time, token for token (preemption, parallel samples, stop tokens, length
limits, aborts, structured output); a sequence that finished costs at most one step more and never emits a token
past its end. The service's own tests (test_services, test_failover, ...) run with it on, its default."""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.sampling_params import SamplingParams
from base.structured_output import StructuredOutput
from scheduler.core import RequestOutput, Scheduler
from tests.engine_fixtures import random_prompts, tiny_engine
from tests.unit.scheduler.test_scheduler import EOS, FakeWorker, make_scheduler, params


def run_pipelined(scheduler: Scheduler, worker, depth: int, abort: dict[int, str] | None = None
                  ) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Drive the scheduler as the service's engine loop does, with up to `depth` steps in flight (the worker runs
    each as it is sent, in order, as the real one does); abort: request ids to abort once that many steps were
    built. Returns each sample's tokens, finish reasons, and how many steps were built while another was in
    flight."""
    in_flight, outputs, ahead, built = deque(), [], 0, 0
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < depth and (step := scheduler.schedule()) is not None:
            ahead += bool(in_flight)
            in_flight.append((step, worker.step(step)))
            built += 1
            if abort and built in abort:
                scheduler.abort_request(abort[built])
        if in_flight:
            outputs += scheduler.update(*in_flight.popleft())
    return collect(outputs) + (ahead,)


def run_overlapped(scheduler: Scheduler, worker, abort: dict[int, str] | None = None
                   ) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Drive the scheduler as the service does with a worker that overlaps (gpu_worker/process.py): each step is
    launched as soon as it is built, which finishes the one before it; the last one is finished when nothing more
    can be built. Returns what run_pipelined does."""
    sent, outputs, ahead, built = deque(), [], 0, 0
    while scheduler.has_unfinished_requests() or sent:
        step = scheduler.schedule() if len(sent) < 2 else None
        if step is not None:
            ahead += bool(sent)
            sent.append(step)
            built += 1
            result = worker.launch(step)
            if abort and built in abort:
                scheduler.abort_request(abort[built])
        else:
            result = worker.finish()
        if result is not None:
            outputs += scheduler.update(sent.popleft(), result)
    return collect(outputs) + (ahead,)


def collect(outputs: list[RequestOutput]) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens, reasons = {}, {}
    for out in outputs:
        key = f"{out.request_id}/{out.index}"
        tokens.setdefault(key, []).extend(out.new_token_ids)
        if out.finish_reason:
            assert key not in reasons, f"{key} finished twice"
            reasons[key] = out.finish_reason
    return tokens, reasons


def assert_drained(scheduler: Scheduler) -> None:
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert not scheduler.in_flight and not scheduler.running and not scheduler.waiting


def add_mix(scheduler: Scheduler, seed: int) -> None:
    """Eight requests of every kind; one the scheduler refuses (too long for a small pool) is left out."""
    for i, prompt in enumerate(random_prompts(seed, 8, range(2, 30))):
        kind = i % 4
        p = (params(3 + i, n=2, temperature=1.0, seed=i) if kind == 0 else
             params(12, ignore_eos=False) if kind == 1 else
             params(20, stop_token_ids=(7, 11)) if kind == 2 else params(6 + i))
        try:
            scheduler.add_request(f"r{i}", [t % 90 + 3 for t in prompt], p)
        except ValueError:
            pass


@pytest.mark.parametrize("num_blocks", [64, 14])   # 14 blocks of 4: preemptions
def test_two_steps_in_flight_give_the_tokens_of_one_at_a_time(num_blocks: int) -> None:
    results = {}
    for depth in (1, 2):
        scheduler = make_scheduler(num_blocks=num_blocks, max_model_len=48, max_num_batched_tokens=16)
        add_mix(scheduler, seed=num_blocks)
        *results[depth], ahead = run_pipelined(scheduler, FakeWorker(), depth)
        assert_drained(scheduler)
        assert (ahead > 0) == (depth == 2)
    assert results[2] == results[1]
    tokens, reasons = results[1]
    assert {"stop", "length"} <= set(reasons.values())
    assert all(len(tokens[key]) <= 48 for key in tokens)


def test_a_sequence_that_finishes_costs_at_most_one_step_and_emits_nothing_past_its_end() -> None:
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request("short", [5, 6, 7], params(3))
    scheduler.add_request("eos", [8, 9], params(30, ignore_eos=False))
    tokens, reasons, _ = run_pipelined(scheduler, worker, depth=2)
    assert len(tokens["short/0"]) == 3 and reasons["short/0"] == "length"
    computed_for_short = sum(1 for step in worker.steps for s in [*step.new_seqs, *step.cached_seqs]
                             if s.seq_id == "short/0")
    assert computed_for_short == 3      # prompt, then 2 decodes: its length was known, nothing ran past it
    if reasons["eos/0"] == "stop":      # an EOS is known only when it arrives: one step more at most
        assert tokens["eos/0"][-1] == EOS and EOS not in tokens["eos/0"][:-1]


def test_aborts_while_steps_are_in_flight_free_everything() -> None:
    scheduler = make_scheduler(num_blocks=20, max_num_batched_tokens=8)
    add_mix(scheduler, seed=5)
    tokens, reasons, _ = run_pipelined(scheduler, FakeWorker(), 2, abort={3: "r1", 4: "r2", 9: "r5"})
    assert_drained(scheduler)
    assert not {"r1/0", "r2/0", "r5/0"} & set(reasons)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(10, 40), budget=st.integers(1, 24))
def test_in_any_mix_two_steps_in_flight_give_the_tokens_of_one_at_a_time(seed: int, num_blocks: int,
                                                                         budget: int) -> None:
    results = []
    for depth in (1, 2):
        scheduler = make_scheduler(num_blocks=num_blocks, max_model_len=40, max_num_batched_tokens=budget)
        add_mix(scheduler, seed)
        results.append(run_pipelined(scheduler, FakeWorker(), depth)[:2])
        assert_drained(scheduler)
    assert results[0] == results[1]


def test_the_real_worker_gives_the_same_tokens_with_two_steps_in_flight_as_with_one(tiny_llama_dir) -> None:
    """The model and its sampler behind the scheduler, as in the service: seeds, parallel samples, stop tokens,
    penalties, a regex grammar and preemptions."""
    prompts = random_prompts(seed=9, count=10, lengths=range(3, 40))
    params_list = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True) for i in range(6)] + [
        SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(17, 41, 99)),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                       structured_output=StructuredOutput("regex", "[ab]{3,12}"))]
    outputs = {}
    for depth in (1, 2):
        engine = tiny_engine(tiny_llama_dir, kv_cache_memory=24 * 2 * 2 * 4 * 2 * 16 * 4,
                             max_num_batched_tokens=32)   # 24 blocks: preemptions
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            engine.add_request(f"r{i}", prompt, p)
        while engine.scheduler.compiling:   # the grammar compiles on a thread
            engine.scheduler.queue_compiled()
        *outputs[depth], ahead = run_pipelined(engine.scheduler, engine.worker, depth)
        assert (ahead > 0) == (depth == 2)
        assert engine.stats().num_free_blocks == engine.info.num_blocks and engine.stats().num_preemptions > 0
    assert outputs[2] == outputs[1]


def test_a_worker_that_launches_each_step_before_the_last_ones_tokens_are_back_gives_the_same_tokens(
        tiny_llama_dir, monkeypatch) -> None:
    """worker_overlap: the tokens a step samples feed the next step's positions on the device (here a CPU), never
    read by the host first; seeds, parallel samples, stop tokens, penalties, logprobs, a grammar, preemption and
    aborts give what one step at a time gives."""
    from gpu_worker.model_runner import ModelRunner

    fed = []
    fed_rows = ModelRunner.fed_rows
    monkeypatch.setattr(ModelRunner, "fed_rows", lambda runner, chunks: fed.extend(fed_rows(runner, chunks))
                        or fed_rows(runner, chunks))
    prompts = random_prompts(seed=4, count=11, lengths=range(3, 40))
    params_list = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True) for i in range(5)] + [
        SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, top_k=20, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(17, 41, 99)),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2,
                       frequency_penalty=0.5, presence_penalty=0.3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, logit_bias={5: 3.0}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                       structured_output=StructuredOutput("regex", "[ab]{3,12}"))]
    outputs = {}
    for overlap in ("off", "on"):
        engine = tiny_engine(tiny_llama_dir, kv_cache_memory=24 * 2 * 2 * 4 * 2 * 16 * 4,
                             max_num_batched_tokens=32, worker_overlap=overlap)   # 24 blocks: preemptions
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            engine.add_request(f"r{i}", prompt, p)
        while engine.scheduler.compiling:   # the grammar compiles on a thread
            engine.scheduler.queue_compiled()
        abort = {6: "r2", 11: "r4"}
        if overlap == "on":
            *outputs[overlap], ahead = run_overlapped(engine.scheduler, engine.worker, abort)
        else:
            *outputs[overlap], ahead = run_pipelined(engine.scheduler, engine.worker, 2, abort)
        assert ahead > 0
        assert engine.stats().num_free_blocks == engine.info.num_blocks and engine.stats().num_preemptions > 0
        assert engine.worker.finish() is None
    assert outputs["on"] == outputs["off"]
    assert len(fed) > 20   # positions whose input came from the previous step's sampled ids on the device
    assert not {"r2/0", "r4/0"} & set(outputs["on"][1])


def test_overlap_is_refused_where_it_cannot_work(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="async scheduling"):
        tiny_engine(tiny_llama_dir, worker_overlap="on", async_scheduling=False)
    engine = tiny_engine(tiny_llama_dir)   # auto: off on a CPU, where results would only come a step later
    assert not engine.worker.overlaps
    with pytest.raises(RuntimeError, match="without overlap"):
        engine.worker.launch(engine.scheduler.schedule() or None)
