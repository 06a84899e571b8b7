"""Prompt-lookup speculative decoding on the tiny model: the output is the one without it, token for token (greedy
and seeded), and unseeded samples follow the model's distribution."""
from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest
import torch

from base.structured_output import StructuredOutput
from ferry import SamplingParams
from tests.conftest import build_tiny_llama, transformers_greedy
from tests.engine_fixtures import hf_model, kv_bytes_for, random_prompts, tiny_engine

__all__ = ["hf_model"]   # the shared fixture

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                    "disable_by_batch_size": 1024})
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat a span: the random model's output now and then repeats a bit of it (proposals are kept)
    and mostly does not (they are rejected)."""
    return [p + p for p in random_prompts(seed=1, count=16, lengths=range(4, 24))]


def generate_both(model_dir, prompts, params, **overrides):
    """(without, with speculation, the speculating engine)"""
    plain = tiny_engine(model_dir, **overrides).generate(prompts, params)
    engine = tiny_engine(model_dir, speculative_config=NGRAM, **overrides)
    return plain, engine.generate(prompts, params), engine


def assert_kept_some(engine) -> None:
    counters = engine.scheduler.counters
    assert counters.spec_accepted_tokens > 10, counters   # else the comparison proves nothing
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_output_is_transformers_token_for_token(tiny_llama_dir, hf_model, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = tiny_engine(tiny_llama_dir, speculative_config=NGRAM)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == transformers_greedy(hf_model, prompts, MAX_TOKENS)
    assert_kept_some(engine)


@pytest.mark.parametrize("overrides", [
    {"kv_cache_memory": kv_bytes_for(None, 40), "max_model_len": 96},   # preemption
    {"max_num_batched_tokens": 9},                                        # chunked prefill, proposals in the budget
    {"enable_prefix_caching": False},
], ids=["preemption", "small-budget", "no-prefix-cache"])
def test_greedy_output_is_unchanged_under_pressure(tiny_llama_dir, prompts, overrides):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, speculated, engine = generate_both(tiny_llama_dir, prompts, params, **overrides)
    assert [r.token_ids for r in speculated] == [r.token_ids for r in plain]
    assert_kept_some(engine)
    if "kv_cache_memory" in overrides:
        assert engine.stats().num_preemptions > 0


def test_seeded_samples_and_their_logprobs_are_the_same(tiny_llama_dir, prompts):
    params = SamplingParams(temperature=0.3, top_k=5, seed=3, n=2, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    plain = tiny_engine(tiny_llama_dir).generate(prompts, params)
    engine = tiny_engine(tiny_llama_dir, speculative_config=NGRAM)
    speculated = [engine.scheduler.add_request(f"s{i}", p, params) for i, p in enumerate(prompts)]
    logprobs: dict[tuple[str, int], list] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            logprobs.setdefault((out.request_id, out.index), []).extend(out.new_logprobs)
    assert speculated is not None
    assert [tokens[(f"s{i}", j)] for i in range(len(prompts)) for j in range(2)] == \
        [s.token_ids for r in plain for s in r.samples]
    for key, entries in logprobs.items():
        assert [e.token_id for e in entries] == tokens[key]
        assert all(len(e.top) == 2 for e in entries)
    assert_kept_some(engine)


def test_a_stop_token_inside_kept_proposals_ends_the_output_there(tiny_llama_dir, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = tiny_engine(tiny_llama_dir).generate(prompts[:8], greedy)
    stops = [r.token_ids[MAX_TOKENS // 2] for r in plain]   # a token of each output's second half
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop])
              for stop in stops]
    expected = [r.token_ids[:r.token_ids.index(stop) + 1] for r, stop in zip(plain, stops)]
    engine = tiny_engine(tiny_llama_dir, speculative_config=NGRAM)
    assert [r.token_ids for r in engine.generate(prompts[:8], params)] == expected
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_constrained_requests_check_each_proposal_against_their_grammar(tiny_llama_dir):
    """A regex and bad words: every proposed token is checked against its position's mask and sampled under it,
    so the output is the one without speculation (and matches the regex, with no banned word)."""
    text = "the cat sat on the mat. the cat sat on the mat. the cat sat"
    regex = StructuredOutput("regex", spec="[a-z .]{40,80}")
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=regex),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=("cat",)),
              SamplingParams(temperature=0.8, seed=2, max_tokens=MAX_TOKENS, structured_output=regex,
                             bad_words=("mat",))]
    plain, speculated, engine = generate_both(tiny_llama_dir, [text] * 3, params)
    assert [r.token_ids for r in speculated] == [r.token_ids for r in plain]
    assert engine.scheduler.counters.spec_accepted_tokens > 0
    assert re.fullmatch("[a-z .]*", speculated[0].text) and re.fullmatch("[a-z .]*", speculated[2].text)


def test_unseeded_samples_follow_the_models_distribution(tiny_llama_dir, hf_model):
    """3-token continuations sampled with speculation on, against their exact probabilities from transformers
    (top-3 at temperature 1): Pearson's chi-square must not reject them at p = 0.001."""
    base = random_prompts(seed=1, count=1, lengths=range(4, 8))[0]
    greedy = tiny_engine(tiny_llama_dir).generate([base], SamplingParams(temperature=0, max_tokens=6))[0]
    prompt = base + greedy.token_ids + base   # its continuation often repeats what followed base: proposals
    num_samples, length = 3000, 3
    engine = tiny_engine(tiny_llama_dir, speculative_config=NGRAM, max_num_seqs=256)
    results = engine.generate([prompt] * num_samples,
                              SamplingParams(temperature=1.0, top_k=3, max_tokens=length, ignore_eos=True))
    assert engine.scheduler.counters.spec_accepted_tokens > 100
    observed = Counter(tuple(r.token_ids) for r in results)
    expected = {path: p * num_samples for path, p in path_probabilities(hf_model, prompt, length, top_k=3).items()}
    assert set(observed) <= set(expected)
    statistic = sum((observed[path] - e) ** 2 / e for path, e in expected.items())
    p_value = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2), torch.tensor(statistic / 2)).item()
    assert p_value > 0.001, (statistic, len(expected))


def path_probabilities(model, prompt: list[int], length: int, top_k: int) -> dict[tuple[int, ...], float]:
    """Every continuation of `length` tokens top-k sampling can give, with its probability."""
    paths = {(): 1.0}
    for _ in range(length):
        grown = {}
        for path, p in paths.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(path)])).logits[0, -1].double()
            top = logits.topk(top_k)
            for token, q in zip(top.indices.tolist(), torch.softmax(top.values, dim=0).tolist()):
                grown[(*path, token)] = p * q
        paths = grown
    return paths


def test_the_worker_is_sent_only_the_table_after_rolled_back_blocks(tiny_llama_dir):
    """Rejected proposals past a block boundary give that block back; the worker then gets the whole table."""
    engine = tiny_engine(tiny_llama_dir, speculative_config=NGRAM)
    prompt = list(itertools.chain.from_iterable([[5, 6, 7, 8, 9, 10, 11]] * 4))
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.scheduler.counters.spec_proposed_tokens > 0


@pytest.fixture(scope="module")
def other_tiny_llama_dir(tmp_path_factory):
    """A second random model of the same vocabulary: a draft whose proposals are mostly rejected."""
    return build_tiny_llama(tmp_path_factory.mktemp("other-tiny-llama"), seed=1)


def draft_config(model_dir) -> str:
    return json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 1024})


@pytest.mark.parametrize("draft", ["itself", "another model"])
def test_a_draft_models_greedy_output_is_transformers_token_for_token(tiny_llama_dir, other_tiny_llama_dir,
                                                                       hf_model, prompts, draft):
    draft_dir = tiny_llama_dir if draft == "itself" else other_tiny_llama_dir
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = tiny_engine(tiny_llama_dir, speculative_config=draft_config(draft_dir))
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == transformers_greedy(hf_model, prompts, MAX_TOKENS)
    counters = engine.scheduler.counters
    rate = counters.spec_accepted_tokens / counters.spec_proposed_tokens
    assert rate > 0.95 if draft == "itself" else rate < 0.5, counters
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_a_draft_model_keeps_seeded_samples_under_preemption(tiny_llama_dir, prompts):
    params = SamplingParams(temperature=0.7, top_k=20, seed=5, n=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    overrides = {"kv_cache_memory": kv_bytes_for(None, 40), "max_model_len": 96}
    plain = tiny_engine(tiny_llama_dir, **overrides).generate(prompts, params)
    engine = tiny_engine(tiny_llama_dir, speculative_config=draft_config(tiny_llama_dir),
                         kv_cache_memory=2 * kv_bytes_for(None, 40), max_model_len=96)
    assert engine.info.num_blocks == 40   # the draft's pool takes its share of the bytes
    speculated = engine.generate(prompts, params)
    assert [s.token_ids for r in speculated for s in r.samples] == [s.token_ids for r in plain for s in r.samples]
    assert engine.stats().num_preemptions > 0 and engine.scheduler.counters.spec_accepted_tokens > 100


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_engine(tiny_llama_dir, speculative_config=draft_config(tmp_path))


def test_constrained_requests_with_proposals_survive_preemption(tiny_llama_dir):
    """A grammar row whose proposals were checked in a step that then preempted it keeps its mask: it samples
    again once readmitted, and every output is the one without speculation."""
    text = "the cat sat on the mat. the cat sat on the mat. the cat sat"
    regex = StructuredOutput("regex", spec="[a-z .]{40,80}")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=regex)
    overrides = {"kv_cache_memory": kv_bytes_for(None, 40), "max_model_len": 96}
    plain, speculated, engine = generate_both(tiny_llama_dir, [text + " " * i for i in range(8)], params, **overrides)
    assert engine.stats().num_preemptions > 0 and engine.scheduler.counters.spec_proposed_tokens > 0
    assert [r.token_ids for r in speculated] == [r.token_ids for r in plain]
