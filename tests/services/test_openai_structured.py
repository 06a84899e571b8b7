"""Structured outputs over the OpenAI HTTP API, on the default model (SmolLM2-135M-Instruct) behind a real router:
`response_format` through the official client's `parse`, 20 JSON schemas that validate at temperature 0 and 1,
vLLM's `structured_outputs` / `guided_*` fields, `logit_bias`, `min_tokens` and `bad_words`; bad constraints are
400s with the reason and the server serves on."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from ferry.launcher import free_port
from gpu_worker.loading.model_files import default_model_dir
from tests.services_fixtures import API_KEY, HttpStack, start_services, wait_until

pytestmark = pytest.mark.slow

EOS = 2   # SmolLM2's <|im_end|>
SMALL_STRING = {"type": "string", "maxLength": 12}
SMALL_INTEGER = {"type": "integer", "minimum": -1000, "maximum": 1000}   # unbounded, the model may write digits on


def obj(required: list[str] | None = None, **properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required}


SCHEMAS = {
    "flat": obj(name=SMALL_STRING, age={"type": "integer", "minimum": 0, "maximum": 120}),
    "nested": obj(user=obj(id=SMALL_INTEGER, active={"type": "boolean"})),
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 1, "maxItems": 4},
    "enum": obj(color={"enum": ["red", "green", "blue"]}),
    "bounded_number": obj(score={"type": "number", "minimum": 0, "maximum": 1}),
    "optional_fields": obj(["title"], title=SMALL_STRING, subtitle=SMALL_STRING, pages=SMALL_INTEGER),
    "pattern": obj(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    "booleans": obj(a={"type": "boolean"}, b={"type": "boolean"}, c={"type": "boolean"}),
    "any_of": obj(value={"anyOf": [SMALL_INTEGER, {"type": "string", "maxLength": 8}]}),
    "array_of_objects": obj(items={"type": "array", "minItems": 1, "maxItems": 3, "items": obj(
        sku={"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"}, qty={"type": "integer", "minimum": 1, "maximum": 9})}),
    "deep": obj(a=obj(b=obj(c=obj(d=SMALL_INTEGER)))),
    "integer_enum": {"enum": [1, 2, 3]},
    "null": obj(deleted={"type": "null"}, id=SMALL_INTEGER),
    "string_array": obj(tags={"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}),
    "refs": {"$defs": {"point": obj(x=SMALL_INTEGER, y=SMALL_INTEGER)},
             **obj(start={"$ref": "#/$defs/point"}, end={"$ref": "#/$defs/point"})},
    "product": obj(id=SMALL_INTEGER, price={"type": "number", "minimum": 0, "maximum": 1000},
                   currency={"enum": ["USD", "EUR"]}, in_stock={"type": "boolean"}),
    "nullable": obj(nickname={"anyOf": [SMALL_STRING, {"type": "null"}]}),
    "matrix": obj(rows={"type": "array", "maxItems": 2,
                        "items": {"type": "array", "maxItems": 2, "items": SMALL_INTEGER}}),
    "date": obj(year={"type": "integer", "minimum": 1900, "maximum": 2100},
                month={"type": "integer", "minimum": 1, "maximum": 12},
                day={"type": "integer", "minimum": 1, "maximum": 31}),
    "shape": obj(shape={"anyOf": [obj(radius={"type": "number", "minimum": 0, "maximum": 10}),
                                  obj(side={"type": "integer", "minimum": 1, "maximum": 10})]}),
}


@pytest.fixture(scope="module")
def stack() -> Iterator[HttpStack]:
    """One scheduler serving the default model (room for 40 concurrent requests), and a router with HTTP."""
    http_port = free_port()
    services = start_services(default_model_dir(), num_schedulers=1,
                              router_flags=("--http-port", str(http_port), "--api-key", API_KEY),
                              **{"--kv-cache-memory": str(1 << 29), "--max-model-len": "1024"})
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200, "HTTP health")
        yield HttpStack(services, f"http://127.0.0.1:{http_port}/v1", default_model_dir().name,
                        services.router_address)
    finally:
        services.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def chat(stack: HttpStack, content: str, **fields) -> httpx.Response:
    return stack.post("/chat/completions", {"model": stack.model, "messages": [{"role": "user", "content": content}],
                                            **fields})


def completion(stack: HttpStack, prompt: str, **fields) -> httpx.Response:
    return stack.post("/completions", {"model": stack.model, "prompt": prompt, **fields})


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


# --- the official client's parse -----------------------------------------------------------------------------
class Weather(BaseModel):
    city: Literal["Paris", "London", "Rome"]
    temperature_c: int = Field(ge=-30, le=50)
    sunny: bool
    summary: str = Field(max_length=40)


@pytest.mark.parametrize("path", ["chat.completions", "beta.chat.completions"])
def test_openai_client_parse_returns_the_pydantic_object(stack, path):
    completions = stack.client()
    for name in path.split("."):
        completions = getattr(completions, name)
    result = completions.parse(model=stack.model, temperature=0, response_format=Weather,
                               messages=[{"role": "user", "content": "What is the weather in Paris today?"}])
    message = result.choices[0].message
    assert isinstance(message.parsed, Weather)
    assert message.parsed == Weather.model_validate_json(message.content)
    assert result.choices[0].finish_reason == "stop"


# --- 20 JSON schemas, greedy and sampled ---------------------------------------------------------------------
def schema_request(stack: HttpStack, name: str, temperature: float) -> tuple[str, dict]:
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    choice = ok(chat(stack, f"Give me an example of {name.replace('_', ' ')} data as JSON.", max_tokens=200,
                     temperature=temperature, seed=7, response_format=response_format))
    return name, choice


def test_twenty_json_schemas_validate_at_temperature_0_and_1(stack):
    assert len(SCHEMAS) == 20
    cases = [(name, temperature) for name in SCHEMAS for temperature in (0.0, 1.0)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: schema_request(stack, *case), cases))
    unfinished = [(name, choice["message"]["content"]) for name, choice in results if choice["finish_reason"] != "stop"]
    assert not unfinished
    for name, choice in results:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])


# --- vLLM's fields and json_object, over plain HTTP ----------------------------------------------------------
@pytest.mark.parametrize("field", [{"guided_choice": ["yes", "no", "maybe"]},
                                   {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}])
def test_choice_answers_with_exactly_one_of_the_strings(stack, field):
    assert ok(completion(stack, "Is the sky blue?", temperature=1.0, seed=3, **field))["text"] in {
        "yes", "no", "maybe"}


@pytest.mark.parametrize("field", [{"guided_regex": r"[0-9]{3}-[a-z]{2}"},
                                   {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}])
def test_regex_output_matches_the_whole_pattern(stack, field):
    text = ok(chat(stack, "Invent a ticket number.", temperature=1.0, seed=4, max_tokens=32, **field))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text["message"]["content"])


def test_grammar_output_is_a_sentence_of_the_grammar(stack):
    grammar = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'
    text = ok(chat(stack, "Is Paris in France?", temperature=0, max_tokens=32,
                   structured_outputs={"grammar": grammar}))["message"]["content"]
    assert text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("field", [{"response_format": {"type": "json_object"}},
                                   {"structured_outputs": {"json_object": True}},
                                   {"guided_json": json.dumps(SCHEMAS["flat"])}])
def test_json_fields_give_a_json_object(stack, field):
    choice = ok(chat(stack, "Give me a JSON object with the keys name and age for Ann, who is 30.", temperature=0,
                     max_tokens=200, **field))
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_text_response_format_is_unconstrained(stack):
    plain = ok(completion(stack, "The capital of France is", temperature=0, max_tokens=8))
    text = ok(completion(stack, "The capital of France is", temperature=0, max_tokens=8,
                         response_format={"type": "text"}))
    assert text["text"] == plain["text"]


def test_streamed_json_schema_output_validates(stack):
    body = {"model": stack.model, "messages": [{"role": "user", "content": "A person, as JSON."}], "temperature": 0,
            "max_tokens": 200, "stream": True, "guided_json": SCHEMAS["flat"]}
    with httpx.stream("POST", stack.base_url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMAS["flat"])


# --- logit_bias and min_tokens --------------------------------------------------------------------------------
def test_logit_bias_of_100_forces_a_token_and_minus_100_forbids_one(stack, tokenizer):
    (banana,) = tokenizer.encode(" banana", add_special_tokens=False)
    forced = ok(completion(stack, "The capital of France is", temperature=0, max_tokens=4, ignore_eos=True,
                           logit_bias={str(banana): 100}))
    assert forced["text"] == " banana" * 4
    plain = ok(completion(stack, "The capital of France is", temperature=0, max_tokens=1))["text"]
    (first,) = tokenizer.encode(plain, add_special_tokens=False)
    banned = ok(completion(stack, "The capital of France is", temperature=0, max_tokens=1,
                           logit_bias={str(first): -100}))
    assert banned["text"] != plain


def test_allowed_token_ids_are_all_that_comes_out(stack, tokenizer):
    (banana,) = tokenizer.encode(" banana", add_special_tokens=False)
    (apple,) = tokenizer.encode(" apple", add_special_tokens=False)
    text = ok(completion(stack, "The capital of France is", temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                         allowed_token_ids=[banana, apple]))["text"]
    assert text.replace(" banana", "").replace(" apple", "") == "" and len(text.split()) == 6
    refused = completion(stack, "Hi", allowed_token_ids=[10 ** 6])
    assert refused.status_code == 400 and "allowed_token_ids" in refused.text


def test_skip_special_tokens_false_keeps_them_in_the_text(stack):
    forced = {"logit_bias": {str(EOS): 100}, "temperature": 0, "max_tokens": 2, "ignore_eos": True}
    assert ok(completion(stack, "Hello", **forced))["text"] == ""
    assert ok(completion(stack, "Hello", skip_special_tokens=False, **forced))["text"] == "<|im_end|>" * 2
    streamed = completion(stack, "Hello", skip_special_tokens=False, stream=True, **forced)
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "<|im_end|>" * 2
    ended = completion(stack, "Hello", skip_special_tokens=False, logit_bias={str(EOS): 100}, temperature=0).json()
    assert ended["choices"][0]["text"] == "" and ended["choices"][0]["finish_reason"] == "stop"   # its EOS: no text
    assert ended["usage"]["completion_tokens"] == 1


def test_min_tokens_holds_back_the_end_of_the_text(stack):
    eager = {"logit_bias": {str(EOS): 100}, "temperature": 0, "max_tokens": 10}
    assert completion(stack, "Hello", **eager).json()["usage"]["completion_tokens"] == 1
    held = completion(stack, "Hello", min_tokens=5, **eager).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"


def test_bad_words_keep_a_word_out_of_the_answer(stack):
    question = "What is the capital of France?"
    assert "Paris" in ok(chat(stack, question, temperature=0, max_tokens=24))["message"]["content"]
    assert "Paris" not in ok(chat(stack, question, temperature=0, max_tokens=24,
                                  bad_words=["Paris"]))["message"]["content"]
    assert ok(chat(stack, question, temperature=0, guided_choice=["Paris", "London"],
                   bad_words=["Paris"]))["message"]["content"] == "London"


# --- bad constraints: 400 with the reason, and the server serves on ------------------------------------------
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "could not be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "could not be compiled"),
    ({"guided_grammar": "root ::= undefined_rule"}, "could not be compiled"),
    ({"guided_json": "{not json"}, "guided_json: json_schema is not valid JSON"),
    ({"guided_choice": []}, "choice needs 1"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}},
     "at most one structured output constraint per request, got response_format, guided_regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.regex, structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"logit_bias": {"banana": 5}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {"999999": 5}}, "logit_bias token ids must lie in"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"bad_words": ["  "]}, "bad_words must not be empty"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, reason", BAD)
def test_bad_constraint_is_400_with_the_reason_and_the_server_serves_on(stack, fields, reason, stream):
    response = chat(stack, "Hello", stream=stream, **{"max_tokens": 8, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert reason in error["message"] and error["type"] == "invalid_request_error"
    assert ok(completion(stack, "Hello", max_tokens=2, guided_choice=["hi", "yo"]))["text"] in ("hi", "yo")


def test_no_request_is_left_behind_after_refusals(stack):
    wait_until(stack.idle, "the scheduler idle with every block free")
