"""Structured outputs (a JSON schema, a regex, a choice, ...), logit_bias and min_tokens: what a user asks for is
what comes out, token-exact against transformers with the same xgrammar mask, through batching and preemption."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from base.sampling_params import SamplingParams
from base.structured_output import StructuredOutput
from protos import common_pb2, router_pb2
from tests.engine_fixtures import hf_model, kv_bytes_for, random_prompts, tiny_engine
from tests.services_fixtures import collect, greedy, start_services

__all__ = ["hf_model"]   # the shared fixture

EOS = 2   # the tiny tokenizer's <|im_end|>
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


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir, num_schedulers=1)
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
