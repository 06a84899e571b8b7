"""Prefix caching: shared prompt blocks are computed once, and a hit never changes outputs."""
from __future__ import annotations

import random

from ferry import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model_dir, **overrides) -> Engine:
    config = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=16, kv_cache_memory=1 << 24,
                  max_model_len=1024)
    config.update(overrides)
    return Engine(EngineConfig(**config))


def shared_prefix_prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    prefix = [rng.randrange(3, 400) for _ in range(512)]
    return [prefix + [rng.randrange(3, 400) for _ in range(rng.randrange(16, 40))] for _ in range(count)]


def test_outputs_are_identical_with_prefix_caching_on_and_off(tiny_llama_dir):
    prompts = shared_prefix_prompts(6)
    cached = engine(tiny_llama_dir)
    first_wave = cached.generate(prompts[:3], GREEDY)
    second_wave = cached.generate(prompts, GREEDY)       # all hit the prefix now, some their whole prompt
    uncached = engine(tiny_llama_dir, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [r.token_ids for r in second_wave] == [r.token_ids for r in uncached]
    assert [r.token_ids for r in first_wave] == [r.token_ids for r in uncached[:3]]
    assert cached.stats().prefix_cache_hits > 0


def test_a_shared_512_token_prefix_is_computed_once(tiny_llama_dir):
    first, second = shared_prefix_prompts(2)
    eng = engine(tiny_llama_dir)
    eng.generate([first], GREEDY)
    prompt_tokens_before = eng.stats().prompt_tokens_total
    eng.add_request("second", second, GREEDY)
    step = eng.scheduler.schedule()
    assert [s.num_computed_tokens for s in step.new_seqs] == [512]
    assert [s.num_scheduled_tokens for s in step.new_seqs] == [len(second) - 512]   # only the suffix
    outputs = eng.scheduler.update(step, eng.worker.step(step))
    while eng.has_unfinished_requests():
        outputs += eng.step()
    assert outputs[0].num_cached_tokens == 512 and sum(len(o.new_token_ids) for o in outputs) == 8
    assert eng.stats().prompt_tokens_total - prompt_tokens_before == len(second) - 512
    assert eng.stats().prefix_cache_hits == 512


def test_prefix_caching_off_computes_everything(tiny_llama_dir):
    first, second = shared_prefix_prompts(2)
    eng = engine(tiny_llama_dir, enable_prefix_caching=False)
    eng.generate([first, second], GREEDY)
    assert eng.stats().prompt_tokens_total == len(first) + len(second)
    assert eng.stats().prefix_cache_hits == 0


def test_parallel_seeded_samples_are_the_same_with_prefix_caching_on_and_off(tiny_llama_dir):
    prompts = shared_prefix_prompts(3)
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=11, n=2, ignore_eos=True)
    outputs = []
    for caching in (True, False):
        eng = engine(tiny_llama_dir, enable_prefix_caching=caching)
        eng.generate(prompts[:1], params)
        outputs.append([[s.token_ids for s in r.samples] for r in eng.generate(prompts, params)])
        assert eng.stats().num_free_blocks == eng.info.num_blocks
    assert outputs[0] == outputs[1]


def test_four_parallel_samples_allocate_a_512_token_prompt_once(tiny_llama_dir):
    eng = engine(tiny_llama_dir, enable_prefix_caching=False)
    prompt = shared_prefix_prompts(1)[0][:512]
    eng.add_request("n4", prompt, SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=8, ignore_eos=True))
    peak = 0
    samples: dict[int, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            samples.setdefault(out.index, []).extend(out.new_token_ids)
        stats = eng.stats()
        peak = max(peak, stats.num_blocks - stats.num_free_blocks)
    assert peak == 512 // 16 + 4          # the prompt's 32 blocks once, then one output block per sample
    assert sorted(samples) == [0, 1, 2, 3] and all(len(t) == 8 for t in samples.values())
    assert eng.stats().num_free_blocks == eng.stats().num_blocks
