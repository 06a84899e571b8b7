"""The sampling fields are declared once, in protos/common.proto's SamplingParams (names, types, defaults, ranges):
the dataclass, the proto conversion, the range checks and the HTTP APIs' fields follow the declaration, so a field is
named only where it is declared and where it is honoured."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import UnionType
from typing import get_args, get_origin, get_type_hints

import pytest

from base.sampling_params import RANGES, SAMPLING_FIELDS, SamplingParams
from base.structured_output import StructuredOutput
from protos import common_pb2, field_rules_pb2
from router.http.schema import OWN_FIELDS, PLAIN_FIELDS, ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[3]
SERVING = ["base", "protos", "router", "scheduler", "gpu_worker"]   # not its users (ferry's CLI, benchmarks, tests)
DECLARED = {"protos/common.proto"}
# Each field with a name no other code uses, and the files that honour it (what adding one such field touches)
PLACES = {
    # the model's generation_config.json gives these defaults under the same names (router/generation_defaults.py)
    "top_p": {"gpu_worker/sampling/sampler.py", "gpu_worker/cuda/device_memory.py", "router/generation_defaults.py",
              "router/http/responses.py"},   # and the Responses API takes it (as a chat's) under its name
    "min_p": {"gpu_worker/sampling/sampler.py", "router/generation_defaults.py"},
    "presence_penalty": {"gpu_worker/sampling/sampler.py"},
    "frequency_penalty": {"gpu_worker/sampling/sampler.py"},
    "repetition_penalty": {"gpu_worker/sampling/sampler.py", "router/generation_defaults.py"},
    "stop_token_ids": {"base/sampling_params.py",                 # its count check
                       "gpu_worker/sampling/logit_masks.py", "scheduler/stopping.py", "scheduler/grammar_masks.py",
                       "scheduler/grammar_compilation.py",    # there: xgrammar's argument, the model's stop tokens
                       "scheduler/grammar_drafts.py"},        # and the model's, which end a grammar's proposals
    "ignore_eos": {"gpu_worker/sampling/logit_masks.py", "scheduler/stopping.py"},
    "include_stop_str_in_output": {"router/core.py"},
    "allowed_token_ids": {"base/sampling_params.py",              # its count check
                          "scheduler/request_checks.py", "gpu_worker/sampling/logit_masks.py"},
    "truncate_prompt_tokens": {"base/sampling_params.py",         # its -1-or-at-least-1 check
                               "router/core.py", "router/prompt_length.py", "router/http/app.py"},
    "bad_words": {"base/sampling_params.py", "scheduler/bad_words.py", "scheduler/core.py",
                  "scheduler/grammar_compilation.py", "scheduler/grammar_masks.py", "scheduler/grammar_drafts.py"},
    "return_embedding": {"gpu_worker/model_runner.py",            # gathers it (and keeps such rows out of graphs)
                         "router/http/embeddings.py", "router/http/schema.py"},   # asks for it; not on completions
    "structured_output_after": {"base/sampling_params.py",        # its count check
                                "scheduler/core.py",              # handed to the grammar with the prompt
                                "router/http/app.py", "router/http/schema.py"},   # set by --reasoning-parser only
}
CANDIDATES = {int: [2, 3], float: [0.5, 1.5], bool: [True, False], tuple[str, ...]: [("x",)], tuple[int, ...]: [(3,)],
              dict[int, float]: [{3: 1.5}], StructuredOutput: [StructuredOutput("regex", "a+")]}


def files_naming(name: str) -> set[str]:
    """The serving code's sources (not the generated stubs) that name the field."""
    sources = [*(p for d in SERVING for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name),
               *(ROOT / "protos").glob("*.proto")]
    word = re.compile(rf"\b{name}\b")
    return {str(p.relative_to(ROOT)) for p in sources if word.search(p.read_text())}


def declared_type(name: str) -> type:
    hint = get_type_hints(SamplingParams)[name]
    return next(t for t in get_args(hint) if t is not type(None)) if get_origin(hint) is UnionType else hint


def changed_value(name: str):
    """A value other than the default that the field accepts: one of its type's candidates."""
    for value in CANDIDATES[declared_type(name)]:
        try:
            if SamplingParams(**{name: value}) != SamplingParams():
                return value
        except ValueError:
            continue
    raise AssertionError(f"no candidate value fits {name}")


def test_the_dataclass_holds_exactly_the_wire_messages_fields_in_its_order():
    assert SAMPLING_FIELDS == tuple(f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields)


@pytest.mark.parametrize("name, default", [("max_tokens", 16), ("temperature", 1.0), ("top_k", -1), ("n", 1),
                                           ("seed", None), ("logprobs", None), ("ignore_eos", False), ("stop", ()),
                                           ("logit_bias", {}), ("structured_output", None)])
def test_an_unset_field_means_the_default_its_wire_field_declares(name, default):
    value = getattr(SamplingParams(), name)
    assert value == default and type(value) is type(default)


@pytest.mark.parametrize("name, bad, message", [
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"), ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("n", 17, r"n must be in \[1, 16\]"), ("max_tokens", 0, "max_tokens must be at least 1"),
    ("temperature", -0.5, "temperature must be at least 0"), ("repetition_penalty", 0.0, "must be above 0"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"), ("prompt_logprobs", 21, "prompt_logprobs")])
def test_a_value_outside_its_declared_range_is_refused_naming_the_field_and_range(name, bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{name: bad})


def test_the_range_checked_is_the_wire_fields_own():
    options = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name["n"].GetOptions()
    assert RANGES["n"].maximum == options.Extensions[field_rules_pb2.maximum] == 16
    assert SamplingParams(n=16).n == 16


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_every_declared_field_crosses_the_wire_both_ways(name):
    params = SamplingParams(**{name: changed_value(name)})
    assert params != SamplingParams()
    assert SamplingParams.from_proto(params.to_proto()) == params
    assert SamplingParams.from_proto(params.to_proto(), trusted=True) == params


def test_unset_fields_take_the_declared_defaults():
    assert SamplingParams.from_proto(common_pb2.SamplingParams()) == SamplingParams()


@pytest.mark.parametrize("name", PLAIN_FIELDS)
def test_both_http_apis_take_each_plain_field_by_its_name_to_the_wire(name):
    value = changed_value(name)
    given = list(value) if isinstance(value, tuple) else value
    completion = CompletionRequest(prompt="hi", **{name: given})
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{name: given})
    max_tokens = value if name == "max_tokens" else None   # the APIs resolve max_tokens their own way
    for request in (completion.generate_request("c", "", None), chat.generate_request("c", "", max_tokens)):
        assert getattr(SamplingParams.from_proto(request.sampling), name) == value


def test_the_fields_the_http_apis_spell_their_own_way_are_declared_fields():
    assert set(OWN_FIELDS) <= set(SAMPLING_FIELDS)
    assert set(PLAIN_FIELDS) | set(OWN_FIELDS) == set(SAMPLING_FIELDS)


@pytest.mark.parametrize("name", sorted(PLACES))
def test_a_sampling_field_is_named_where_it_is_declared_and_where_it_is_honoured_only(name):
    assert name in {f.name for f in dataclasses.fields(SamplingParams)}
    assert files_naming(name) == DECLARED | PLACES[name]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model, required", [(CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, CHAT)])
def test_every_optional_field_takes_null_for_its_default(model, required):
    """OpenAI's clients send null for a parameter they leave unset (vLLM takes it): each one means its default."""
    default = model.model_validate(required)
    for name in set(model.model_fields) - set(required):
        assert getattr(model.model_validate({**required, name: None}), name) == getattr(default, name), name
