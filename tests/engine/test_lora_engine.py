"""Multi-LoRA in the in-process engine: the base model and adapters of three ranks batched in one step, each
request token-exact against PEFT's merged model; KV never shared across adapters; bad adapters refused."""
from __future__ import annotations

import json

import pytest

from ferry import SamplingParams
from gpu_worker.lora.peft_adapter import AdapterRefused
from scheduler.lora_adapters import AdapterNotFound
from tests.conftest import build_tiny_llama, transformers_greedy
from tests.engine_fixtures import random_prompts, tiny_engine
from tests.lora_fixtures import build_peft_adapter, merged_model

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
RANKS = {"a8": 8, "a16": 16, "a64": 64}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    built = {name: str(build_peft_adapter(tiny_llama_dir, root / name, rank, seed=rank))
             for name, rank in RANKS.items()}
    built["qv_only"] = str(build_peft_adapter(tiny_llama_dir, root / "qv_only", 8, seed=3, targets=["q_proj", "v_proj"],
                                              use_rslora=True))
    return built


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(seed=5, count=8, lengths=range(3, 30))


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters, prompts) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens under the base model ("") and under each adapter merged in by PEFT."""
    names = ["", *adapters]
    return {name: transformers_greedy(merged_model(tiny_llama_dir, adapters.get(name)), prompts, MAX_TOKENS)
            for name in names}


def lora_engine(model_dir, adapters: dict[str, str], **overrides):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return tiny_engine(model_dir, enable_lora=True, lora_modules=modules, **{"max_loras": 4, "max_lora_rank": 64,
                                                                              **overrides})


def test_adapters_change_the_output(references):
    """The check below could not fail if the adapters changed nothing."""
    outputs = [tuple(map(tuple, tokens)) for tokens in references.values()]
    assert len(set(outputs)) == len(outputs)


def test_base_and_three_adapters_in_one_step_match_peft_merged_models(tiny_llama_dir, adapters, prompts, references):
    engine = lora_engine(tiny_llama_dir, adapters)
    names = ["", "a8", "a16", "a64"]
    assignment = [names[i % len(names)] for i in range(len(prompts))]
    for i, (prompt, name) in enumerate(zip(prompts, assignment)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_name=name)
    step = engine.scheduler.schedule()
    assert {seq.lora_name for seq in step.new_seqs} == set(names)   # all four in the first step
    tokens: dict[str, list[int]] = {}
    for out in engine.scheduler.update(step, engine.worker.step(step)):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, name in enumerate(assignment):
        assert tokens[f"r{i}"] == references[name][i], f"prompt {i} with adapter {name!r}"


def test_an_adapter_on_some_modules_with_rslora_matches_peft(tiny_llama_dir, adapters, prompts, references):
    engine = lora_engine(tiny_llama_dir, {"qv_only": adapters["qv_only"]})
    results = engine.generate(prompts, GREEDY, lora_names=["qv_only"] * len(prompts))
    assert [r.token_ids for r in results] == references["qv_only"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_layers_run_adapters_too_and_match_peft(tmp_path, prompts, family):
    """Gemma's layers call their linear modules themselves: the modules' forwards carry the adapters. Base rows
    and an adapter's in one batch."""
    from tests.model_families_fixtures import build_tiny_model
    model_dir, _ = build_tiny_model(tmp_path / family, family)
    adapter = str(build_peft_adapter(model_dir, tmp_path / "adapter", 8, seed=2))
    expected = {name: transformers_greedy(merged_model(model_dir, path), prompts, MAX_TOKENS)
                for name, path in (("", None), ("a", adapter))}
    assert expected["a"] != expected[""]
    names = [("a", "")[i % 2] for i in range(len(prompts))]
    engine = lora_engine(model_dir, {"a": adapter})
    results = engine.generate(prompts, GREEDY, lora_names=names)
    assert [r.token_ids for r in results] == [expected[name][i] for i, name in enumerate(names)]


def test_more_adapters_than_slots_take_turns_and_stay_exact(tiny_llama_dir, adapters, prompts, references):
    """One device slot, four adapters: a request waits for its adapter's turn, none is lost or mixed up."""
    engine = lora_engine(tiny_llama_dir, adapters, max_loras=1, max_cpu_loras=2)
    names = ["a8", "a16", "", "a64", "qv_only"]
    assignment = [names[i % len(names)] for i in range(len(prompts))]
    results = engine.generate(prompts, GREEDY, lora_names=assignment)
    for i, (result, name) in enumerate(zip(results, assignment)):
        assert result.token_ids == references[name][i], f"prompt {i} with adapter {name!r}"


def test_kv_blocks_are_never_shared_across_adapters(tiny_llama_dir, adapters, prompts, references):
    """The same prompt under the base model, then two adapters, then the first again: only the repeat hits the
    prefix cache, and each gets its own model's tokens."""
    engine = lora_engine(tiny_llama_dir, adapters)
    index = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert len(prompts[index]) >= 16   # several blocks of 4
    hits = []
    for name in ["", "a8", "a16", "a8", ""]:
        hits_before = engine.stats().prefix_cache_hits
        [result] = engine.generate([prompts[index]], GREEDY, lora_names=[name])
        assert result.token_ids == references[name][index]
        hits.append(engine.stats().prefix_cache_hits - hits_before)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0 and hits[4] > 0


def test_a_request_for_an_adapter_not_loaded_is_refused_by_name(tiny_llama_dir, adapters):
    engine = lora_engine(tiny_llama_dir, {"a8": adapters["a8"]})
    with pytest.raises(AdapterNotFound, match="'nope'"):
        engine.add_request("x", [5, 6, 7], GREEDY, lora_name="nope")
    assert not engine.has_unfinished_requests()


def test_an_adapter_that_does_not_fit_is_refused_at_load_with_the_reason(tiny_llama_dir, adapters, tmp_path):
    engine = lora_engine(tiny_llama_dir, {}, max_lora_rank=16)
    with pytest.raises(AdapterRefused, match="rank 64 is above --max-lora-rank 16"):
        engine.load_lora_adapter("big", adapters["a64"])
    other = build_tiny_llama(tmp_path / "other_base", num_key_value_heads=4)   # wider k and v: the B's do not fit
    with pytest.raises(AdapterRefused, match="do not fit this model"):
        engine.load_lora_adapter("wrong_base", str(build_peft_adapter(other, tmp_path / "wrong", 8, seed=1)))
    with pytest.raises(AdapterRefused, match="no adapter_config.json"):
        engine.load_lora_adapter("empty", str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
    with pytest.raises(AdapterRefused, match="use_dora is not supported"):
        engine.load_lora_adapter("dora", str(tmp_path))
    assert sorted(engine.scheduler.lora.loaded) == []


def test_a_busy_adapter_cannot_keep_another_out_of_the_only_slot_for_ever(tiny_llama_dir, adapters, prompts,
                                                                          references, monkeypatch):
    """One slot, a8 requests arriving every step: an a16 request waiting for the slot stops admissions once it has
    waited SLOT_WAIT_STEPS steps, the a8 batch drains, and a16 runs, exactly."""
    from scheduler import lora_adapters
    monkeypatch.setattr(lora_adapters, "SLOT_WAIT_STEPS", 8)
    engine = lora_engine(tiny_llama_dir, adapters, max_loras=1)
    engine.add_request("busy-0", prompts[0], GREEDY, lora_name="a8")
    engine.step()
    engine.add_request("waiting", prompts[1], GREEDY, lora_name="a16")
    tokens: list[int] = []
    for step in range(200):
        engine.add_request(f"busy-{step + 1}", prompts[step % len(prompts)], GREEDY, lora_name="a8")
        tokens += [t for out in engine.step() if out.request_id == "waiting" for t in out.new_token_ids]
        if len(tokens) == MAX_TOKENS:
            break
    assert tokens == references["a16"][1]
