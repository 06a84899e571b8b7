"""The in-process engine: continuous batching is token-exact against transformers, under any pressure."""
from __future__ import annotations

import pytest

from ferry import SamplingParams
from scheduler.sequence import Tenancy
from tests.conftest import transformers_greedy
from tests.engine_fixtures import hf_model, kv_bytes_for, random_prompts, tiny_engine

__all__ = ["hf_model"]   # the shared fixture

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(seed=0, count=16, lengths=range(1, 48))


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return transformers_greedy(hf_model, prompts, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_batched_greedy_generation_matches_transformers_token_for_token(tiny_llama_dir, prompts, reference):
    engine = tiny_engine(tiny_llama_dir)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == reference
    assert all(r.finish_reason == "length" for r in results)


def test_preempted_requests_finish_with_the_same_tokens(tiny_llama_dir, prompts, reference):
    engine = tiny_engine(tiny_llama_dir, kv_cache_memory=kv_bytes_for(tiny_llama_dir, 24), max_model_len=64)
    assert engine.info.num_blocks == 24
    results = engine.generate(prompts, GREEDY)
    assert engine.stats().num_preemptions > 0
    assert [r.token_ids for r in results] == reference


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_any_scheduling_policy_under_preemption_gives_the_same_tokens(tiny_llama_dir, prompts, reference, policy):
    """Requests of two tenants and three priorities in a pool that preempts: each finishes with transformers' tokens,
    whatever order the policy served them in."""
    engine = tiny_engine(tiny_llama_dir, kv_cache_memory=kv_bytes_for(tiny_llama_dir, 24), max_model_len=64,
                         scheduling_policy=policy, priority_aging_steps=8)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY, Tenancy("ab"[i % 2], priority=i % 3))
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats().num_preemptions > 0
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference


def test_prompts_chunked_by_a_small_token_budget_give_the_same_tokens(tiny_llama_dir, prompts, reference):
    engine = tiny_engine(tiny_llama_dir, max_num_batched_tokens=7)
    results = engine.generate(prompts, GREEDY)
    assert engine.scheduler.counters.chunked_prefills > 0
    assert [r.token_ids for r in results] == reference


def test_the_step_budget_left_at_auto_is_the_devices_and_one_set_by_hand_is_kept(tiny_llama_dir):
    """--max-num-batched-tokens 0 (the default): the worker names its device's budget, 1,024 tokens on a CPU, and
    the scheduler steps by it: of two 600-token prompts the second is chunked; at 2,048 neither is."""
    prompts = random_prompts(seed=5, count=2, lengths=range(600, 601))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    chunked = {}
    for budget in (0, 2048):
        engine = tiny_engine(tiny_llama_dir, max_model_len=1024, max_num_batched_tokens=budget)
        engine.generate(prompts, params)
        chunked[engine.info.max_num_batched_tokens] = engine.scheduler.counters.chunked_prefills
    assert chunked == {1024: 1, 2048: 0}


def test_decodes_keep_running_while_a_long_prompt_is_chunked(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir, max_num_batched_tokens=8)
    engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.add_request("long", list(range(10, 90)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    short_tokens_during_long_prefill = 0
    while engine.scheduler.requests.get("long") and engine.scheduler.requests["long"].seqs[0].num_output_tokens == 0:
        short_tokens_during_long_prefill += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "short")
    assert short_tokens_during_long_prefill >= 8   # 80 prompt tokens at <= 7 per step, one decode each step


def test_static_and_contiguous_baselines_give_the_same_tokens(tiny_llama_dir, prompts, reference):
    for overrides in ({"batching": "static", "max_num_seqs": 5}, {"kv_layout": "contiguous", "max_model_len": 64}):
        engine = tiny_engine(tiny_llama_dir, **overrides)
        assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference


def test_abort_returns_every_block_to_the_pool(tiny_llama_dir, prompts):
    engine = tiny_engine(tiny_llama_dir, enable_prefix_caching=False)
    total = engine.stats().num_free_blocks
    for i, prompt in enumerate(prompts[:6]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_free_blocks < total
    for i in range(6):
        assert engine.abort(f"r{i}")
    assert engine.stats().num_free_blocks == total
    assert not engine.has_unfinished_requests()
    engine.step()   # the worker is told to drop the aborted sequences
    assert engine.worker.runner.seqs == {}


@pytest.mark.parametrize("prompt, params, field", [
    ([], dict(max_tokens=4), "prompt"),
    (list(range(3, 200)), dict(max_tokens=100), "max_model_len"),
    ([5, 6], dict(max_tokens=0), "max_tokens"),
    ([5, 6], dict(temperature=-0.5), "temperature"),
    ([5, 6], dict(top_p=0.0), "top_p"),
    ([5, 6], dict(top_p=1.5), "top_p"),
])
def test_bad_input_is_a_clear_error_and_others_keep_running(tiny_llama_dir, prompt, params, field):
    engine = tiny_engine(tiny_llama_dir)
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    free_before = engine.stats().num_free_blocks
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert engine.stats().num_free_blocks == free_before
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "good") == 5


def test_prompt_that_can_never_fit_the_pool_is_rejected_and_others_keep_running(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir, kv_cache_memory=kv_bytes_for(tiny_llama_dir, 8))
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="prompt.*never fit"):
        engine.add_request("huge", list(range(3, 43)), SamplingParams(max_tokens=4))
    assert engine.stats().num_free_blocks == 8
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["good"] * 5


def test_seeded_sampling_repeats_and_parallel_samples_share_the_prompt(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7, n=3, ignore_eos=True)
    first = engine.generate([list(range(3, 40))], params)[0]
    again = engine.generate([list(range(3, 40)), list(range(50, 60))], [params, params])[0]
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) > 1
    assert engine.stats().num_free_blocks == engine.info.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.5,
                   repetition_penalty=1.3),
    SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True, frequency_penalty=0.8, min_tokens=20),
], ids=["greedy-penalties", "seeded-min-tokens"])
def test_a_request_resumed_after_its_first_tokens_goes_on_with_the_same_ones(tiny_llama_dir, params):
    """What a scheduler that takes over a dead one's stream does: the tokens already sent count as generated
    (penalties, max_tokens, min_tokens, the seeded position), so the rest is what the first one would have sent."""
    engine = tiny_engine(tiny_llama_dir)
    prompt = list(range(3, 40))
    whole = engine.generate([prompt], params)[0].token_ids
    engine.scheduler.add_request("resumed", prompt, params, resumed_token_ids=whole[:9])
    rest = []
    while engine.has_unfinished_requests():
        rest += [t for out in engine.step() for t in out.new_token_ids]
    assert whole[:9] + rest == whole and len(rest) == params.max_tokens - 9
    assert engine.stats().num_free_blocks == engine.info.num_blocks


def test_stop_token_ids_and_eos_end_a_sequence(tiny_llama_dir, prompts, reference):
    engine = tiny_engine(tiny_llama_dir)
    stop_at = reference[0][3]
    result = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                           stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert result.finish_reason == "stop"
    assert result.token_ids == reference[0][:reference[0].index(stop_at) + 1]
    assert result.text == engine.tokenizer.decode(result.token_ids[:-1])   # the stop token is not text (vLLM's)


def test_generate_with_one_bad_prompt_submits_none_of_them(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[5, 6, 7], []], SamplingParams(temperature=0, max_tokens=3))
    assert not engine.has_unfinished_requests()
    assert engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].finish_reason is not None
