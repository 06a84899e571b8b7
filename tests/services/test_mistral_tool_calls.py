"""Mistral's tool calls through a real stack: a tiny model scripted to write Mistral's `[TOOL_CALLS]name[ARGS]{...}`
with `[TOOL_CALLS]` and `[ARGS]` special tokens, as Mistral's tokenizers have them, and a chat template that shows
`[TOOL_CALLS]` (so "auto" reads Mistral's format with no --tool-call-parser). The calls come back though
detokenizing would skip their markers, with 9-character ids the next turn's template takes back. The parser alone,
fed every cut of a stream: tests/unit/router/test_tool_parsers.py."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.services_fixtures import HttpStack, build_scripted_model, start_http_stack

# Mistral's shape, cut down: its tools, its [TOOL_CALLS] turns, and the 9-character ids its templates insist on
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if m.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{% endif %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SCRIPT = ["Let me check.", "[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": "Paris"}']
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Iterator[HttpStack]:
    path = build_scripted_model(tmp_path_factory.mktemp("scripted-mistral"), SCRIPT, MISTRAL_TEMPLATE,
                                special=("[TOOL_CALLS]", "[ARGS]"))
    with start_http_stack(path) as stack:
        yield stack


def chat(stack: HttpStack, messages: list[dict], **fields):
    return stack.client().chat.completions.create(model=stack.model, messages=messages, max_tokens=16,
                                                  temperature=0, **fields)


def test_mistral_calls_come_back_with_ids_its_template_takes(mistral):
    choice = chat(mistral, QUESTION, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(call.id) == 9 and call.id.isalnum()
    turn = [*QUESTION, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    assert chat(mistral, turn, tools=TOOLS).choices[0].message.tool_calls   # rendered: the id was taken back


def test_streamed_mistral_calls_add_up_to_the_whole(mistral):
    deltas = [c.choices[0].delta for c in chat(mistral, QUESTION, tools=TOOLS, stream=True) if c.choices]
    pieces = [piece for d in deltas for piece in d.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and len(pieces[0].id) == 9
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Paris"}
    assert "".join(d.content or "" for d in deltas) == "Let me check."


def test_without_tools_the_special_markers_stay_out_of_the_text(mistral):
    assert chat(mistral, QUESTION).choices[0].message.content == 'Let me check.get_weather{"city": "Paris"}'
