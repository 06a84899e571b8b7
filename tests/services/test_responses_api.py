"""OpenAI's Responses API (POST /v1/responses) on a real stack, read by the official `openai` client: a response is
the chat its instructions and input make (token-exact against transformers), whole or as typed events that add up
to it; a reasoning model's thinking and tool calls come as reasoning and function_call items, and a conversation
that carries a call and its output runs as the same chat through /v1/chat/completions. Its refusals:
test_openai_errors.py."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.openai_fixtures import reference, stack
from tests.services.test_reasoning import ANSWER, QUESTION, REASONING, THINKING, TOOLS
from tests.services_fixtures import HttpStack, build_scripted_model, start_http_stack
from tests.unit.router.test_tool_parsers import HERMES_TEMPLATE

__all__ = ["reference", "stack"]   # the shared fixtures

INSTRUCTIONS = "You are terse."
ASKED = "What is the capital of France?"
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]   # the Responses API's shape


def test_a_response_is_the_answer_of_its_chat_as_transformers_gives_it(stack, reference):
    prompt_ids = reference.chat_ids([{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASKED}])
    want_ids, _ = reference.greedy(prompt_ids, 16)
    response = stack.client().responses.create(model=stack.model, instructions=INSTRUCTIONS, input=ASKED,
                                               max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == stack.model
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == reference.decode(want_ids)
    assert response.usage.input_tokens == len(prompt_ids) and response.usage.output_tokens == len(want_ids)
    assert response.status == ("incomplete" if len(want_ids) == 16 else "completed")
    assert response.store is False and response.instructions == INSTRUCTIONS


def test_input_messages_with_text_parts_are_the_chats_messages(stack, reference):
    messages = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": ASKED}]
    want_ids, _ = reference.greedy(reference.chat_ids(messages), 8)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                          {"type": "input_text", "text": "city."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
             {"role": "user", "content": ASKED}]
    response = stack.client().responses.create(model=stack.model, input=items, max_output_tokens=8, temperature=0)
    assert response.output_text == reference.decode(want_ids)
    assert response.usage.input_tokens == len(reference.chat_ids(messages))


def test_a_streamed_response_is_numbered_events_that_add_up_to_the_whole(stack):
    fields = dict(model=stack.model, input=ASKED, max_output_tokens=12, temperature=0)
    whole = stack.client().responses.create(**fields)
    events = list(stack.client().responses.create(stream=True, **fields))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Iterator[HttpStack]:
    path: Path = build_scripted_model(tmp_path_factory.mktemp("scripted-thinker"), THINKING + ANSWER,
                                      HERMES_TEMPLATE)
    with start_http_stack(path, router_flags=("--reasoning-parser", "deepseek_r1")) as stack:
        yield stack


def test_the_thinking_and_the_calls_come_as_their_own_items(thinker):
    response = thinker.client().responses.create(model=thinker.model, input=QUESTION, tools=FLAT_TOOLS,
                                                 max_output_tokens=64, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.content[0].text == REASONING
    assert message.content[0].text == "I will check. "
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert response.status == "completed"


def test_streamed_thinking_and_calls_add_up_to_the_whole(thinker):
    fields = dict(model=thinker.model, input=QUESTION, tools=FLAT_TOOLS, max_output_tokens=64, temperature=0)
    whole = thinker.client().responses.create(**fields)
    events = list(thinker.client().responses.create(stream=True, **fields))
    reasoning = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(reasoning) > 1 and "".join(reasoning) == REASONING
    arguments = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert arguments.name == "get_weather" and arguments.arguments == whole.output[2].arguments
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    final = events[-1].response
    assert [item.type for item in final.output] == added and final.output[0].content[0].text == REASONING


def test_a_call_and_its_output_in_the_input_run_as_the_same_chat(thinker):
    """The next turn after a call: its function_call and function_call_output items are the assistant's tool call
    and the tool's message of a chat completion."""
    conversation = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    chat = thinker.client().chat.completions.create(model=thinker.model, messages=conversation, tools=TOOLS,
                                                    max_tokens=64, temperature=0)
    items = [*QUESTION, {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                         "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
    response = thinker.client().responses.create(model=thinker.model, input=items, tools=FLAT_TOOLS,
                                                 max_output_tokens=64, temperature=0)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output[0].content[0].text == chat.choices[0].message.reasoning
    called = chat.choices[0].message.tool_calls[0].function
    assert response.output[2].name == called.name and json.loads(response.output[2].arguments) == json.loads(
        called.arguments)
