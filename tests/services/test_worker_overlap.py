"""A scheduler service whose worker process overlaps its steps (--worker-overlap on, forced on this CPU): each step
launched before the previous one's tokens are back, fed from them on the device. Served streams are those of the
in-process engine, token for token, under concurrency, stop strings, seeds and a cancelled stream."""
from __future__ import annotations

import os
import re
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from base.sampling_params import SamplingParams
from protos import router_pb2, scheduler_pb2_grpc
from tests.services_fixtures import (ConnectStream, cancel_beside_others, child_pids, collect, free_port, greedy,
                                     matching_engine, start_services, wait_until)

PROMPTS = [f"Paris is the capital of France {i}. The quick brown fox" for i in range(12)]
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir, num_schedulers=1, **{"--worker-overlap": "on",
                                                                  "--metrics-port": str(METRICS_PORT)})
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return matching_engine(tiny_llama_dir)


def test_overlapped_steps_serve_what_one_step_at_a_time_gives(services, engine):
    """A stop token ends a sequence in a step whose successor already computes past it; a stop string's request is
    aborted upstream while its steps overlap; a seeded one draws what it draws alone."""
    free_run = engine.generate([PROMPTS[8]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    full_text = engine.generate([PROMPTS[10]], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].text
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    wanted = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True) for i in range(8)] + [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(free_run.token_ids[9],)),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True)]
    expected = [engine.generate([prompt], params)[0] for prompt, params in zip(PROMPTS, wanted)]

    def run(i: int):
        p = wanted[i]
        sampling = greedy(p.max_tokens, ignore_eos=p.ignore_eos, stop_token_ids=list(p.stop_token_ids),
                          repetition_penalty=p.repetition_penalty, stop=[stop] if i == 10 else [])
        sampling.temperature = p.temperature
        if p.seed is not None:
            sampling.seed = p.seed
        return collect(services.router().Generate(router_pb2.GenerateRequest(text=PROMPTS[i], sampling=sampling)))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, range(len(PROMPTS))))
    for i, ((token_ids, text, _), want) in enumerate(zip(results, expected)):
        if i == 10:
            assert text == full_text[:full_text.index(stop)]
        else:
            assert token_ids == want.token_ids and text == want.text
    assert expected[8].finish_reason == "stop" and len(expected[8].token_ids) < 40
    wait_until(services.idle, "every block free again")
    assert fed_tokens() > 50   # the decodes' inputs came from the step before, on the device


def fed_tokens() -> float:
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics").read().decode()
    return float(re.search(r"^ferry:worker_fed_tokens_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))


def test_a_cancelled_stream_frees_its_blocks_while_steps_overlap(services, engine):
    expected = engine.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    cancel_beside_others(services, PROMPTS[5], PROMPTS[:3], greedy(24, ignore_eos=True), expected)


def test_a_killed_overlapping_worker_loses_no_request_and_its_successor_overlaps_too(services, engine):
    """Killed with a step launched and the next one sent: the requests go on with the new worker, token for token."""
    address, scheduler = services.scheduler_addresses[0], services.schedulers[0]
    stub = scheduler_pb2_grpc.SchedulerStub(services.channel(address))
    stream = ConnectStream(stub)
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12, 13]}
    for request_id, prompt in prompts.items():
        stream.submit(request_id, prompt, greedy(300, ignore_eos=True))
    stream.read_until(lambda: all(len(stream.tokens(r)) > 5 for r in prompts))
    fed_before = fed_tokens()
    os.kill(child_pids(scheduler.pid)[0], signal.SIGKILL)
    stream.read_until(lambda: all(stream.done(r) for r in prompts))
    assert not stream.errors
    for request_id, prompt in prompts.items():
        want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))[0]
        assert stream.tokens(request_id) == want.token_ids
    stream.cancel()
    assert fed_tokens() > fed_before + 100   # the new worker's steps were fed on the device as well
