"""--speculative-config through the services: a scheduler with async scheduling verifies proposals, the router
streams several tokens a message (stop strings cut inside them), and the counters reach /metrics."""
from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from ferry import SamplingParams
from protos import router_pb2
from tests.engine.test_speculative_decoding import NGRAM
from tests.engine_fixtures import random_prompts, tiny_engine
from tests.services_fixtures import collect, free_port, greedy, start_services

PROMPTS = [p + p for p in random_prompts(seed=1, count=12, lengths=range(4, 24))]
MAX_TOKENS = 32
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir, num_schedulers=1, **{"--speculative-config": NGRAM,
                                                                  "--metrics-port": str(METRICS_PORT)})
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                        ignore_eos=True))


def generate(services, prompt: list[int], **params):
    return collect(services.router().Generate(router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt), sampling=greedy(MAX_TOKENS, ignore_eos=True, **params))))


def test_concurrent_greedy_streams_are_the_engines_without_speculation(services, expected):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate(services, p), PROMPTS))
    assert [token_ids for token_ids, _, _ in results] == [r.token_ids for r in expected]
    assert any(len(m.token_ids) > 1 for _, _, messages in results for m in messages)   # kept proposals


def test_a_stop_string_inside_kept_proposals_cuts_the_text_there(services, expected):
    for result, prompt in zip(expected, PROMPTS):
        stop = result.text[len(result.text) // 2:][:3]
        if stop.strip():
            break
    _, text, messages = generate(services, prompt, stop=[stop])
    assert text == result.text[:result.text.index(stop)]
    assert messages[-1].stop_reason == stop


def test_the_acceptance_counters_reach_metrics(services):
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics").read().decode()
    accepted = [line for line in metrics.splitlines() if line.startswith("ferry:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0
    assert 'ferry:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in metrics
