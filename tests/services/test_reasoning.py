"""A reasoning model's thinking through a real stack (redis-server, a scheduler with its worker, a router serving
HTTP with --reasoning-parser), read by the official `openai` client as vLLM serves it: the message's `reasoning`
apart from its content, streamed as `delta.reasoning`, and tool calls read from the content after the thinking.
The model is a tiny one scripted to think and then answer (test_tool_calls.py's kind); the parsers alone, fed every
cut of a stream: tests/unit/router/test_reasoning_parser.py."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services_fixtures import HttpStack, build_scripted_model, start_http_stack
from tests.unit.router.test_tool_parsers import HERMES_TEMPLATE

THINKING = ["<think>", "The user asks ", "about Paris.", "</think>"]
ANSWER = ["I will check. ", "<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
          "\n</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
REASONING = "The user asks about Paris."


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory) -> Path:
    return build_scripted_model(tmp_path_factory.mktemp("scripted-thinker"), THINKING + ANSWER, HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def thinker(thinker_dir) -> Iterator[HttpStack]:
    with start_http_stack(thinker_dir, router_flags=("--reasoning-parser", "deepseek_r1")) as stack:
        yield stack


def chat(stack: HttpStack, **fields):
    return stack.client().chat.completions.create(model=stack.model, messages=QUESTION, max_tokens=64,
                                                  temperature=0, **fields)


def test_the_thinking_comes_as_reasoning_apart_from_the_content(thinker):
    message = chat(thinker).choices[0].message
    assert message.reasoning == REASONING
    assert message.content == "".join(ANSWER)
    unthinking = chat(thinker, extra_body={"include_reasoning": False}).choices[0].message
    assert getattr(unthinking, "reasoning", None) is None and unthinking.content == "".join(ANSWER)


def test_tool_calls_are_read_after_the_thinking(thinker):
    choice = chat(thinker, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning == REASONING
    assert choice.message.content == "I will check. "
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["text", "tools"])
def test_streamed_reasoning_and_content_add_up_to_the_message(thinker, tools):
    whole = chat(thinker, **({"tools": tools} if tools else {})).choices[0].message
    stream = chat(thinker, stream=True, **({"tools": tools} if tools else {}))
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    reasoning_pieces = [d.reasoning for d in deltas if getattr(d, "reasoning", None)]
    assert len(reasoning_pieces) > 1 and "".join(reasoning_pieces) == whole.reasoning == REASONING
    assert "".join(d.content or "" for d in deltas) == (whole.content or "")
    arguments = "".join(c.function.arguments or "" for d in deltas for c in d.tool_calls or [])
    assert arguments == (whole.tool_calls[0].function.arguments if tools else "")


CHOICE = {"structured_outputs": {"choice": ["I will check. ", "No."]}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_structured_output_holds_the_answer_after_the_thinking(thinker, stream):
    """vLLM's: the grammar starts after </think>, so the model thinks as it would and then answers to the grammar."""
    if stream:
        deltas = [c.choices[0].delta for c in chat(thinker, stream=True, extra_body=CHOICE) if c.choices]
        reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = chat(thinker, extra_body=CHOICE).choices[0].message
        reasoning, content = message.reasoning, message.content
    assert reasoning == REASONING and content == "I will check. "   # the script's next piece is cut off


def test_without_the_parser_the_thinking_stays_in_the_content_and_a_grammar_holds_from_the_start(thinker_dir):
    with start_http_stack(thinker_dir) as plain:
        message = chat(plain).choices[0].message
        constrained = chat(plain, extra_body=CHOICE).choices[0].message
    assert getattr(message, "reasoning", None) is None
    assert message.content == "".join(THINKING + ANSWER)
    assert constrained.content in CHOICE["structured_outputs"]["choice"]
