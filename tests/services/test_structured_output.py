"""Structured outputs (a JSON schema, a regex, a choice, ...), logit_bias and min_tokens: what a user asks for is
what comes out, token-exact against transformers with the same xgrammar mask, through batching and preemption."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from base.sampling_params import SamplingParams
from base.structured_output import StructuredOutput
from protos import common_pb2, router_pb2
from scheduler import grammar_compilation
from scheduler.grammar_compilation import GrammarCache
from scheduler.grammar_masks import StructuredOutputManager
from tests.engine_fixtures import hf_model, kv_bytes_for, random_prompts, tiny_engine
from tests.services_fixtures import collect, greedy, start_services

__all__ = ["hf_model"]   # the shared fixture

EOS = 2   # the tiny tokenizer's <|im_end|>
COMPILE_TIMEOUT_S = 1.0   # the services' --structured-output-compile-timeout
# xgrammar compiles an object's optional properties in time cubic in their number or worse: 2.4 s for 1000 on the
# first machines, 0.57 s for 1000, ~1 s for 1200 and 3.3 s for 1400 on a Zen 5 EPYC
COMPILE_BOMB = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(1400)}})
# compiles in a millisecond; then each mask takes longer than the one before (the tiny model's 4th to 7th: 0.04,
# 0.14, 0.3 and 0.6 s)
FILL_BOMB = "root ::= " + "(" * 60 + "[a-z]*" + ")*" * 60
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
            "required": ["kind"], "additionalProperties": False}},
    "required": ["name", "age", "pet"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(PERSON)),
    "regex": StructuredOutput("regex", r"[a-c]{2,4}-\d{2}"),
    "choice": StructuredOutput("choice", choices=("yes", "no way", "maybe")),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(seed=1, count=9, lengths=range(1, 40))


@pytest.fixture(scope="module")
def hf_compiler(tiny_llama_dir):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_llama_dir), vocab_size=512,
                                                   stop_token_ids=[EOS])
    return xgrammar.GrammarCompiler(info)


def compile_for_reference(compiler, constraint: StructuredOutput):
    if constraint.kind == "json_schema":
        return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
    if constraint.kind == "regex":
        return compiler.compile_regex(constraint.spec)
    return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in constraint.choices))


def constrained_reference(model, compiler, prompt: list[int], constraint: StructuredOutput, max_tokens: int
                          ) -> list[int]:
    """transformers' greedy `generate` with xgrammar's own logits processor: the tokens Ferry must produce."""
    from xgrammar.contrib.hf import LogitsProcessor

    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS,
                         logits_processor=[LogitsProcessor(compile_for_reference(compiler, constraint))])
    return out[0, len(prompt):].tolist()


def kinds_for(prompts: list[list[int]]) -> list[str]:
    return [list(CONSTRAINTS)[i % len(CONSTRAINTS)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(hf_model, hf_compiler, prompts) -> list[list[int]]:
    return [constrained_reference(hf_model, hf_compiler, p, CONSTRAINTS[kind], 96)
            for p, kind in zip(prompts, kinds_for(prompts))]


def constrained(kind: str, max_tokens: int = 96, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=CONSTRAINTS[kind], **kwargs)


def test_greedy_constrained_output_matches_transformers_with_the_same_mask(tiny_llama_dir, prompts, reference):
    engine = tiny_engine(tiny_llama_dir)
    results = engine.generate(prompts, [constrained(kind) for kind in kinds_for(prompts)])
    assert [r.token_ids for r in results] == reference
    assert all(r.finish_reason == "stop" for r in results)
    for result, kind in zip(results, kinds_for(prompts)):
        if kind == "json_schema":
            jsonschema.validate(json.loads(result.text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(CONSTRAINTS["regex"].spec, result.text)
        else:
            assert result.text in CONSTRAINTS["choice"].choices


def test_constrained_and_unconstrained_requests_share_a_batch_exactly(tiny_llama_dir, prompts, reference, hf_model):
    from tests.conftest import transformers_greedy

    engine = tiny_engine(tiny_llama_dir)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = engine.generate(prompts + prompts, [constrained(k) for k in kinds_for(prompts)] + [free] * len(prompts))
    assert [r.token_ids for r in results[:len(prompts)]] == reference
    assert [r.token_ids for r in results[len(prompts):]] == transformers_greedy(hf_model, prompts, 12)


def test_preempted_constrained_requests_finish_with_exactly_their_tokens(tiny_llama_dir, prompts, reference):
    engine = tiny_engine(tiny_llama_dir, kv_cache_memory=kv_bytes_for(tiny_llama_dir, 36), max_model_len=160)
    results = engine.generate(prompts, [constrained(kind) for kind in kinds_for(prompts)])
    assert engine.stats().num_preemptions > 0
    assert [r.token_ids for r in results] == reference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_json_parses_and_validates_against_its_schema(tiny_llama_dir, seed):
    engine = tiny_engine(tiny_llama_dir)
    params = SamplingParams(temperature=1.0, seed=seed, n=3, max_tokens=120,
                            structured_output=CONSTRAINTS["json_schema"])
    results = engine.generate(["The quick brown", "Paris is the capital of"], params)
    samples = [s for r in results for s in r.samples]
    assert all(s.finish_reason == "stop" for s in samples)
    for sample in samples:
        jsonschema.validate(json.loads(sample.text), PERSON)
    assert len({s.text for s in samples}) > 1


def test_json_object_output_is_a_json_object(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=200, structured_output=StructuredOutput("json_object"))
    for result in engine.generate(["The quick brown", "Paris is"], params):
        if result.finish_reason == "stop":
            assert isinstance(json.loads(result.text), dict)
        else:   # a random model may write a long object: what is there is an object's beginning
            assert result.text.startswith("{")


@pytest.mark.parametrize("constraint, reason", [
    (StructuredOutput("regex", "a(b"), "could not be compiled"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "nonsense"}}})),
     "could not be compiled"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), "could not be compiled"),
])
def test_a_grammar_that_fails_to_compile_fails_its_request_with_the_reason(tiny_llama_dir, constraint, reason):
    engine = tiny_engine(tiny_llama_dir)
    engine.add_request("bad", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, structured_output=constraint))
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    bad = [o for o in outputs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finish_reason == "abort" and reason in bad[0].error
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "good") == 8
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_invalid_json_schema_text_is_refused_before_it_reaches_a_scheduler():
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(structured_output=StructuredOutput("json_schema", "{not json"))
    with pytest.raises(ValueError, match="choice"):
        SamplingParams(structured_output=StructuredOutput("choice", choices=()))


def test_structured_fields_survive_the_wire():
    params = SamplingParams(structured_output=CONSTRAINTS["choice"], logit_bias={7: -3.5, 9: 100.0}, min_tokens=4)
    assert SamplingParams.from_proto(params.to_proto()) == params
    assert SamplingParams.from_proto(SamplingParams().to_proto()).structured_output is None


def test_logit_bias_forces_and_forbids_tokens(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    base = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = engine.generate(["The quick brown"], base)[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={300: 100.0})
    forbidden = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100.0})
    assert engine.generate(["The quick brown"], forced)[0].token_ids == [300] * 6
    assert engine.generate(["The quick brown"], forbidden)[0].token_ids[0] != plain[0]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias token ids"):
        engine.generate(["hi"], SamplingParams(logit_bias={512: 1.0}))


def test_allowed_token_ids_keep_the_output_to_them_and_greedy_takes_the_best_of_them(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    plain = engine.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    allowed = (plain.token_ids[0], 300, 301)
    greedy = engine.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                 allowed_token_ids=allowed))[0]
    assert greedy.token_ids[0] == plain.token_ids[0] and set(greedy.token_ids) <= set(allowed)
    others = (300, 301, 302)
    sampled = engine.generate(["The quick brown"], SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                                                  ignore_eos=True, allowed_token_ids=others))[0]
    assert set(sampled.token_ids) <= set(others) and len(set(sampled.token_ids)) > 1
    with pytest.raises(ValueError, match="allowed_token_ids token ids"):
        engine.generate(["hi"], SamplingParams(allowed_token_ids=(5, 512)))


def test_min_tokens_holds_back_eos_and_stop_token_ids_until_reached(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    eager = {EOS: 100.0, 300: 90.0}   # EOS first, then token 300, then anything else
    ends_at_once = engine.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=10,
                                                                       logit_bias=eager))[0]
    assert ends_at_once.token_ids == [EOS] and ends_at_once.finish_reason == "stop"
    held = engine.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=10, logit_bias=eager,
                                                               min_tokens=4))[0]
    assert held.token_ids == [300, 300, 300, 300, EOS] and held.finish_reason == "stop"
    stop_id = engine.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                  logit_bias={300: 100.0}, stop_token_ids=(300,),
                                                                  min_tokens=2))[0]
    assert 300 not in stop_id.token_ids[:2] and stop_id.token_ids[2:] == [300] and stop_id.finish_reason == "stop"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_bitmask_unpacking_masks_exactly_what_xgrammar_masks():
    import xgrammar

    from gpu_worker.sampling.logit_masks import unpack_bitmasks

    words = torch.randint(-2**31, 2**31 - 1, (3, 16), dtype=torch.int32)
    logits = torch.randn(3, 500)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, words)
    ours = logits.masked_fill(~unpack_bitmasks([row.numpy().tobytes() for row in words], 500), float("-inf"))
    assert torch.equal(ours, expected)


def test_requests_with_the_same_spec_share_one_compile(tiny_llama_dir, monkeypatch):
    compiled = []
    compile_spec = grammar_compilation.compile_spec
    monkeypatch.setattr(grammar_compilation, "compile_spec", lambda compiler, c: compiled.append(c) or
                        compile_spec(compiler, c))
    engine = tiny_engine(tiny_llama_dir)
    first = engine.generate(["The quick brown", "Paris is", "The quick brown"],
                            [constrained("json_schema"), constrained("json_schema"), constrained("regex")])
    again = engine.generate(["The quick brown"], constrained("json_schema"))   # after the others ended: cached
    assert compiled == [CONSTRAINTS["json_schema"], CONSTRAINTS["regex"]]
    assert again[0].token_ids == first[0].token_ids
    assert all(r.finish_reason == "stop" for r in first + again)


def test_a_schema_pattern_with_a_long_counted_repetition_compiles(tiny_llama_dir):
    """xgrammar 0.2.8's cache fails this compile (an internal check): it is compiled again without it."""
    schema = {"type": "string", "pattern": "^[a-z]{1,300}$"}
    engine = tiny_engine(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput("json_schema",
                                                                                              json.dumps(schema)))
    result = engine.generate(["The quick brown"], params)[0]
    assert result.finish_reason in ("stop", "length")
    assert re.fullmatch(r'"[a-z]*', result.text)


def test_a_grammar_slow_to_fill_does_not_slow_the_rows_beside_it(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    engine.generate(["hi"], constrained("regex", max_tokens=2))   # xgrammar loaded, the model warm
    engine.add_request("bomb", [5, 6, 7], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, structured_output=StructuredOutput("grammar", FILL_BOMB)))
    bomb_tokens = []
    while len(bomb_tokens) < 3:
        bomb_tokens += [t for o in engine.step() for t in o.new_token_ids]
    engine.add_request("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    step_seconds, finished = [], []
    while engine.has_unfinished_requests():
        start = time.monotonic()
        outputs = engine.step()
        step_seconds.append(time.monotonic() - start)
        finished += [o.request_id for o in outputs if o.finish_reason]
        bomb_tokens += [t for o in outputs if o.request_id == "bomb" for t in o.new_token_ids]
    assert finished == ["plain", "bomb"]   # its 24 tokens came while the bomb's masks were being filled
    assert max(step_seconds) < 0.3
    assert len(bomb_tokens) == 8 and re.fullmatch("[a-z]+", engine.tokenizer.decode(bomb_tokens))


def test_a_grammar_whose_masks_take_longer_than_the_time_limit_fails_its_request_and_frees_its_blocks(
        tiny_llama_dir):
    """The fill bomb's masks double in time each token: past the limit (0.3 s, about its 5th) it fails with the
    reason, well before its 30 tokens, and the request beside it is served whole."""
    engine = tiny_engine(tiny_llama_dir, structured_output_compile_timeout=0.3)
    engine.add_request("bomb", [5, 6, 7], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, structured_output=StructuredOutput("grammar", FILL_BOMB)))
    engine.add_request("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    outputs, deadline = [], time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outputs += engine.step()
    bomb = [o for o in outputs if o.request_id == "bomb"]
    assert bomb[-1].finish_reason == "abort" and "--structured-output-compile-timeout" in bomb[-1].error
    assert sum(len(o.new_token_ids) for o in bomb) < 30
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "plain") == 24
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


@dataclass
class FakeGrammar:
    nbytes: int


def done(nbytes: int) -> Future:
    future = Future()
    future.set_result(FakeGrammar(nbytes))
    return future


def test_the_grammar_cache_keeps_what_is_in_use_and_evicts_the_least_recently_used_past_its_bound():
    cache = GrammarCache(max_bytes=250)
    for key in "abc":
        cache.acquire(key, lambda: done(100))
    cache.release("a")
    cache.release("b")
    assert list(cache.entries) == ["a", "b", "c"]     # 200 bytes unused, "c" in use
    cache.release("c")                                 # 300: the least recently used goes
    assert list(cache.entries) == ["b", "c"] and cache.num_bytes == 200
    assert cache.acquire("b", lambda: done(100)).result().nbytes == 100 and cache.num_compiles == 3
    with ThreadPoolExecutor(1) as pool:
        gate = pool.submit(time.sleep, 0.5)
        queued = cache.acquire("d", lambda: pool.submit(FakeGrammar, 100))
        cache.release("d")                             # nobody waits for it and it has not started: dropped
        assert queued.cancelled() and "d" not in cache.entries
        gate.result()


def test_a_request_left_waiting_for_a_compile_thread_is_overload_not_a_bad_spec(tiny_llama_dir):
    """One compile thread, busy with a bomb past the time limit: the bomb is the spec's fault (INVALID_ARGUMENT),
    the small regex queued behind it the scheduler's load (RESOURCE_EXHAUSTED, retry later)."""
    manager = StructuredOutputManager(str(tiny_llama_dir), 512, [EOS], compile_workers=1, compile_timeout=0.5)
    manager.submit("bomb", StructuredOutput("json_schema", COMPILE_BOMB))
    manager.submit("small", CONSTRAINTS["regex"])
    failed, deadline = [], time.monotonic() + 60
    while len(failed) < 2 and time.monotonic() < deadline:
        ready, new = manager.collect()
        assert ready == []
        failed += new
        time.sleep(0.05)
    manager.compilation.shutdown()
    by_id = {f.request_id: f for f in failed}
    assert not by_id["bomb"].overloaded and "--structured-output-compile-timeout" in by_id["bomb"].reason
    assert by_id["small"].overloaded and "retry later" in by_id["small"].reason


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir, num_schedulers=1,
                           **{"--structured-output-compile-timeout": str(COMPILE_TIMEOUT_S)})
    yield stack
    stack.stop()


def test_router_generate_serves_constraints_and_refuses_a_bad_one_with_the_reason(services, tiny_llama_dir):
    regex = common_pb2.StructuredOutput(regex=CONSTRAINTS["regex"].spec)
    request = router_pb2.GenerateRequest(text="The quick brown", sampling=greedy(96, structured_output=regex))
    token_ids, text, messages = collect(services.router().Generate(request))
    expected = tiny_engine(tiny_llama_dir).generate(["The quick brown"], constrained("regex"))[0]
    assert token_ids == expected.token_ids and re.fullmatch(CONSTRAINTS["regex"].spec, text)
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    bad = router_pb2.GenerateRequest(text="hello", sampling=greedy(8, structured_output=common_pb2.StructuredOutput(
        regex="a(b")))
    with pytest.raises(grpc.RpcError) as error:
        collect(services.router().Generate(bad))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be compiled" in error.value.details()
    assert collect(services.router().Generate(request))[0] == expected.token_ids   # and it serves on


def test_a_grammar_bomb_gets_invalid_argument_naming_the_time_limit_while_a_request_beside_it_is_served(
        services, tiny_llama_dir):
    bomb = router_pb2.GenerateRequest(text="hello", sampling=greedy(8, structured_output=common_pb2.StructuredOutput(
        json_schema=COMPILE_BOMB)))
    regex = common_pb2.StructuredOutput(regex=CONSTRAINTS["regex"].spec)
    beside = router_pb2.GenerateRequest(text="The quick brown", sampling=greedy(96, structured_output=regex))
    with ThreadPoolExecutor(2) as pool:
        bombed = pool.submit(lambda: collect(services.router().Generate(bomb, timeout=60)))
        served = pool.submit(lambda: collect(services.router().Generate(beside, timeout=60)))
        with pytest.raises(grpc.RpcError) as error:
            bombed.result()
        token_ids = served.result()[0]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--structured-output-compile-timeout" in error.value.details()
    assert token_ids == tiny_engine(tiny_llama_dir).generate(["The quick brown"], constrained("regex"))[0].token_ids
