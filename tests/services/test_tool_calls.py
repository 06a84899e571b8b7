"""Tool calling through a real stack (redis-server, a scheduler with its worker, a router serving HTTP), driven by
the official `openai` client: tool_choice "required" and a named function on the default model (SmolLM2-135M-
Instruct, forced by a grammar: its arguments validate), "auto" read from a Hermes-format model's own output (a
tiny model scripted to call tools, since a 135M model will not do it on its own), and the refusals.
The parsers alone, fed every cut of a stream: test_tool_parsers.py."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from protos import router_pb2, router_pb2_grpc
from tests.services_fixtures import API_KEY, HttpStack, build_scripted_model, greedy, start_http_stack
from tests.unit.router.test_tool_parsers import HERMES_TEMPLATE

WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"hours_ahead": {"type": "integer", "minimum": 0, "maximum": 23}},
                   "required": ["hours_ahead"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time, some hours from now",
                                           "parameters": TIME_PARAMETERS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
# what the scripted model says, a token each: some content, then two calls in Hermes' format
SCRIPT = ["I will check. ", "<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": ',
          '"Paris", "unit": "celsius"}}', "\n</tool_call>", "\n<tool_call>\n", '{"name": "get_time", ',
          '"arguments": {"hours_ahead": 2}}', "</tool_call>"]


@pytest.fixture(scope="module")
def smollm() -> Iterator[HttpStack]:
    from gpu_worker.loading.model_files import default_model_dir

    with start_http_stack(default_model_dir(), **{"--kv-cache-memory": str(200_000_000)}) as stack:
        yield stack


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory) -> Path:
    return build_scripted_model(tmp_path_factory.mktemp("scripted-hermes"), SCRIPT, HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def hermes(scripted_dir) -> Iterator[HttpStack]:
    """No --tool-call-parser: the router sees `<tool_call>` in the chat template and reads Hermes calls."""
    with start_http_stack(scripted_dir) as stack:
        yield stack


def assert_valid_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


# --- forced by a grammar, on the default model --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_return_arguments_valid_for_the_schema(smollm, tool_choice):
    response = smollm.client().chat.completions.create(model=smollm.model, messages=QUESTION, tools=TOOLS,
                                                       tool_choice=tool_choice, max_tokens=120, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls, {"get_weather"} if tool_choice == NAMED else set(SCHEMAS))


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_stream_as_deltas_the_client_reassembles(smollm, tool_choice):
    with smollm.client().chat.completions.stream(model=smollm.model, messages=QUESTION, tools=TOOLS,
                                                 tool_choice=tool_choice, max_tokens=120, temperature=0.7,
                                                 seed=3) as stream:
        deltas = [event.chunk.choices[0].delta for event in stream if event.type == "chunk" and event.chunk.choices]
        final = stream.get_final_completion()
    pieces = [piece for delta in deltas for piece in delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name and len(pieces) > 2
    assert final.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(final.choices[0].message.tool_calls, {"get_weather"} if tool_choice == NAMED
                       else set(SCHEMAS))


@pytest.mark.slow
@pytest.mark.parametrize("body, reason", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "get_stock"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS}, "--tool-call-parser"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "nonsense"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}, "parameters"),
], ids=["unknown name", "no tools", "auto without a format", "invalid schema", "schema not an object"])
def test_bad_tool_requests_get_400_with_the_reason_and_the_server_keeps_serving(smollm, body, reason):
    response = smollm.post("/chat/completions", {"model": smollm.model, "messages": QUESTION, "max_tokens": 8,
                                                 **body})
    assert response.status_code == 400, response.text
    assert reason in response.json()["error"]["message"]
    after = smollm.client().chat.completions.create(model=smollm.model, messages=QUESTION, max_tokens=4)
    assert after.choices[0].message.content


# --- "auto", read from the model's own format ----------------------------------------------------------------
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"hours_ahead": 2})]


def calls_made(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_auto_reads_the_models_hermes_calls_and_keeps_its_text_as_content(hermes):
    response = hermes.client().chat.completions.create(model=hermes.model, messages=QUESTION, tools=TOOLS,
                                                       max_tokens=32)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check. "
    assert calls_made(choice.message.tool_calls) == EXPECTED_CALLS
    assert_valid_calls(choice.message.tool_calls, set(SCHEMAS))


def test_auto_streams_the_calls_as_deltas_the_client_reassembles(hermes):
    with hermes.client().chat.completions.stream(model=hermes.model, messages=QUESTION, tools=TOOLS,
                                                 tool_choice="auto", max_tokens=32) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk" and event.chunk.choices]
        final = stream.get_final_completion()
    pieces = [piece for chunk in chunks for piece in chunk.choices[0].delta.tool_calls or []]
    assert [p.index for p in pieces if p.id] == [0, 1]
    assert all(p.function.name is None for p in pieces if not p.id)
    assert len(pieces) > 2      # the arguments came in more than one piece
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.content == "I will check. "
    assert calls_made(final.choices[0].message.tool_calls) == EXPECTED_CALLS


def test_with_tool_choice_none_the_calls_stay_text(hermes):
    response = hermes.client().chat.completions.create(model=hermes.model, messages=QUESTION, tools=TOOLS,
                                                       tool_choice="none", max_tokens=32)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "".join(SCRIPT)


def test_the_calls_and_their_results_go_back_to_the_model_through_its_template(hermes, scripted_dir):
    """The conversation a client continues: the assistant's calls (content null) and a tool message per call."""
    from transformers import AutoTokenizer

    first = hermes.client().chat.completions.create(model=hermes.model, messages=QUESTION, tools=TOOLS,
                                                    max_tokens=32).choices[0].message
    calls = [call.model_dump() for call in first.tool_calls]
    results = [{"role": "tool", "tool_call_id": call["id"], "content": f"result of {call['function']['name']}"}
               for call in calls]
    conversation = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls}, *results]
    response = hermes.client().chat.completions.create(model=hermes.model, messages=conversation, tools=TOOLS,
                                                       max_tokens=32)
    for call in calls:   # transformers' templates take the arguments as a dict
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = AutoTokenizer.from_pretrained(scripted_dir).apply_chat_template(
        conversation, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert response.usage.prompt_tokens == len(expected)


def test_router_generate_over_grpc_renders_tools_and_tool_messages_too(hermes, scripted_dir):
    from transformers import AutoTokenizer

    call = router_pb2.ToolCall(id="call_1", name="get_time", arguments='{"hours_ahead": 2}')
    chat = router_pb2.ChatMessages(tools=json.dumps(TOOLS), messages=[
        router_pb2.ChatMessage(role="user", content="What time is it in two hours?"),
        router_pb2.ChatMessage(role="assistant", tool_calls=[call]),
        router_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="14:00")])
    request = router_pb2.GenerateRequest(chat=chat, sampling=greedy(4))
    with grpc.insecure_channel(hermes.grpc_address) as channel:
        responses = list(router_pb2_grpc.RouterStub(channel).Generate(
            request, timeout=60, metadata=[("authorization", f"Bearer {API_KEY}")]))
    expected = AutoTokenizer.from_pretrained(scripted_dir).apply_chat_template([
        {"role": "user", "content": "What time is it in two hours?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"hours_ahead": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:00"}], tools=TOOLS, add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]
    assert responses[-1].usage.prompt_tokens == len(expected)


def test_tools_on_the_completions_api_are_refused(hermes):
    with pytest.raises(openai.BadRequestError, match="chat/completions"):
        hermes.client().completions.create(model=hermes.model, prompt="hi", max_tokens=2,
                                           extra_body={"tools": TOOLS})
