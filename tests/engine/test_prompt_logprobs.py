"""prompt_logprobs in the core: every prompt token after the first scored from the prefill's own logits, equal to
transformers' log_softmax over the same prompt, however the prefill is batched, chunked, cached or preempted."""
from __future__ import annotations

import pytest
import torch

from ferry import Engine, SamplingParams
from tests.conftest import transformers_greedy
from tests.engine_fixtures import hf_model, kv_bytes_for, random_prompts, tiny_engine

__all__ = ["hf_model"]   # the shared fixture

TOP = 3
SCORING = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
PLAIN = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(seed=1, count=8, lengths=range(2, 40))


def reference_rows(model, prompt: list[int]) -> torch.Tensor:
    """Row i: the log-probabilities transformers gives prompt token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_logprobs_match(entries, model, prompt: list[int]) -> None:
    rows = reference_rows(model, prompt)
    assert [e.token_id for e in entries] == prompt[1:]
    assert [e.logprob for e in entries] == pytest.approx(rows.gather(1, torch.tensor(prompt[1:])[:, None])
                                                         .squeeze(1).tolist(), abs=1e-3)
    for entry, row in zip(entries, rows):
        values, ids = row.topk(TOP)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-3)


def assert_no_blocks_held(engine: Engine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks


def test_prompt_logprobs_match_transformers_batched_with_plain_requests(tiny_llama_dir, hf_model, prompts):
    engine = tiny_engine(tiny_llama_dir)
    params = [SCORING if i % 2 == 0 else PLAIN for i in range(len(prompts))]
    results = engine.generate(prompts, params)
    for prompt, p, result in zip(prompts, params, results):
        if p is SCORING:
            assert_prompt_logprobs_match(result.prompt_logprobs, hf_model, prompt)
        else:
            assert result.prompt_logprobs is None
    assert [r.token_ids for r in results] == transformers_greedy(hf_model, prompts, 4)
    assert_no_blocks_held(engine)


def test_prompt_logprobs_gathered_across_prefill_chunks(tiny_llama_dir, hf_model, prompts):
    engine = tiny_engine(tiny_llama_dir, max_num_batched_tokens=7)
    results = engine.generate(prompts, SCORING)
    assert engine.scheduler.counters.chunked_prefills > 0
    for prompt, result in zip(prompts, results):
        assert_prompt_logprobs_match(result.prompt_logprobs, hf_model, prompt)
    assert_no_blocks_held(engine)


def test_a_cached_prefix_is_scored_anyway(tiny_llama_dir, hf_model, prompts):
    engine = tiny_engine(tiny_llama_dir)
    prompt = max(prompts, key=len)
    plain = engine.generate([prompt], PLAIN)[0]
    again = engine.generate([prompt], PLAIN)[0]
    assert engine.stats().prefix_cache_hits > 0 and again.token_ids == plain.token_ids   # the prefix is cached
    first, second = engine.generate([prompt], SCORING)[0], engine.generate([prompt], SCORING)[0]
    assert_prompt_logprobs_match(first.prompt_logprobs, hf_model, prompt)
    assert list(second.prompt_logprobs) == list(first.prompt_logprobs)
    assert second.token_ids == plain.token_ids
    assert engine.stats().prefix_cache_queries == 2 * len(prompt)   # the scoring requests never looked it up
    assert_no_blocks_held(engine)


def test_preempted_prefills_still_score_every_prompt_token_once(tiny_llama_dir, hf_model, prompts):
    engine = tiny_engine(tiny_llama_dir, kv_cache_memory=kv_bytes_for(tiny_llama_dir, 24), max_model_len=64,
                         max_num_batched_tokens=16)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      prompt_logprobs=TOP))
    assert engine.stats().num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert_prompt_logprobs_match(result.prompt_logprobs, hf_model, prompt)
    assert_no_blocks_held(engine)


def test_parallel_samples_get_the_prompt_scored_once(tiny_llama_dir, hf_model, prompts):
    engine = tiny_engine(tiny_llama_dir)
    engine.add_request("n3", prompts[0], SamplingParams(n=3, max_tokens=3, seed=7, prompt_logprobs=0))
    outputs = [out for _ in range(50) if engine.has_unfinished_requests() for out in engine.step()]
    scored = [out for out in outputs if out.prompt_logprobs is not None]
    assert len(scored) == 1 and scored[0].index == 0
    assert [e.logprob for e in scored[0].prompt_logprobs] == pytest.approx(
        reference_rows(hf_model, prompts[0]).gather(1, torch.tensor(prompts[0][1:])[:, None]).squeeze(1).tolist(),
        abs=1e-3)
    assert all(not e.top for e in scored[0].prompt_logprobs)
    assert_no_blocks_held(engine)


def test_a_one_token_prompt_has_nothing_to_score(tiny_llama_dir):
    result = tiny_engine(tiny_llama_dir).generate([[42]], SCORING)[0]
    assert result.prompt_logprobs == [] and len(result.token_ids) == 4


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
