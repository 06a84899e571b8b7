"""Tool calls read out of generated text however it is cut into stream deltas (Hermes, Llama 3 JSON, the shapes
tool_choice's grammars force), the grammar each tool_choice becomes, and the chat template rendering of tools
and tool messages. No stack: the real one is in test_tool_calls.py."""
from __future__ import annotations

import json
import random

import pytest

from protos import router_pb2
from router.chat_messages import chat_template_inputs
from router.http.errors import APIError
from router.http.formats import ChatFormat, Choice, Collected
from router.http.schema import ChatCompletionRequest
from router.http.served_models import ServedModel
from router.http.tool_calls import CallsSoFar, detect_parser, tool_plan
from router.http.tool_parsers import (CallArrayParser, HermesParser, Llama3JsonParser, MistralParser, NamedCallParser,
                                      ParsedDelta, ToolCallDelta)
from router.tokenizer import RouterTokenizer

WEATHER = {"city": "Paris \"Ville\" {lumière}", "days": [1, 2], "unit": {"kind": "c"}}
TIME = {"zone": "CET"}
HERMES_TEXT = (f'Let me look that up.\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n'
               f'</tool_call>\n<tool_call>\n{{"arguments": {json.dumps(TIME)}, "name": "get_time"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "$defs": {"z": {"type": "string"}}}}}]


def cuts(text: str, seed: int) -> list[str]:
    """The text in pieces: one character at a time (seed 0), or of random sizes."""
    if seed == 0:
        return list(text)
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 12)
        pieces.append(text[at:at + size])
        at += size
    return pieces


def streamed(parser, pieces: list[str]) -> tuple[str, list[dict], list[ParsedDelta]]:
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    calls = CallsSoFar()
    for delta in deltas:
        calls.add(delta)
    return "".join(d.content for d in deltas), calls.calls, deltas


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("seed", range(6))
def test_hermes_calls_reassemble_from_any_cut_of_the_stream(seed):
    content, calls, _ = streamed(HermesParser(), cuts(HERMES_TEXT, seed))
    assert content == "Let me look that up.\n"
    assert names_and_arguments(calls) == [("get_weather", WEATHER), ("get_time", TIME)]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


def test_a_calls_first_delta_names_it_and_later_ones_only_add_arguments():
    _, _, deltas = streamed(HermesParser(), cuts(HERMES_TEXT, 0))
    pieces = [piece for delta in deltas for piece in delta.tool_calls if piece.index == 0]
    assert pieces[0].id and pieces[0].name == "get_weather"
    assert len(pieces) > 5 and all(p.id is None and p.name is None and p.arguments for p in pieces[1:])


@pytest.mark.parametrize("text", ["Plain answer, no tools.", "a < b and <tool is not a tag", "ends with <tool_ca",
                                  "<tool_call>not json at all</tool_call>",
                                  '<tool_call>{"na\\xme": "f", "name": "\\q"}</tool_call>'])
def test_text_without_a_call_stays_content(text):
    for seed in range(3):
        content, calls, _ = streamed(HermesParser(), cuts(text, seed))
        assert calls == []
        assert content.replace("</tool_call>", "") == text.replace("</tool_call>", "")


def test_a_call_cut_off_by_max_tokens_keeps_what_arrived():
    _, calls, _ = streamed(HermesParser(), ['<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'])
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("text", ['<|python_tag|>{"name": "get_weather", "parameters": %s}; '
                                  '{"name": "get_time", "parameters": %s}',
                                  ' {"name": "get_weather", "arguments": %s};{"name": "get_time", "arguments": %s}'])
def test_llama3_json_calls_after_the_python_tag_or_at_the_start(text, seed):
    content, calls, _ = streamed(Llama3JsonParser(), cuts(text % (json.dumps(WEATHER), json.dumps(TIME)), seed))
    assert content == ""
    assert names_and_arguments(calls) == [("get_weather", WEATHER), ("get_time", TIME)]


@pytest.mark.parametrize("text", ["The weather is fine.", '{"answer": 42}', 'Try {"name": "x"} yourself'])
def test_llama3_json_text_that_is_no_call_stays_content(text):
    for seed in range(3):
        assert streamed(Llama3JsonParser(), cuts(text, seed))[:2] == (text, [])


def test_llama3_json_text_before_the_python_tag_stays_content():
    content, calls, _ = streamed(Llama3JsonParser(), cuts('Checking.<|python_tag|>{"name": "get_time", '
                                                          '"parameters": {"zone": "CET"}}', 2))
    assert content == "Checking." and names_and_arguments(calls) == [("get_time", TIME)]


@pytest.mark.parametrize("seed", range(4))
def test_the_required_grammars_array_becomes_its_calls(seed):
    text = (f'[{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}, '
            '{"name": "get_time", "parameters": {}}]')
    content, calls, _ = streamed(CallArrayParser(), cuts(text, seed))
    assert content == "" and names_and_arguments(calls) == [("get_weather", WEATHER), ("get_time", {})]


def test_a_named_choices_whole_output_is_the_arguments():
    content, calls, _ = streamed(NamedCallParser(name="get_weather"), cuts(json.dumps(WEATHER), 3))
    assert content == "" and names_and_arguments(calls) == [("get_weather", WEATHER)]


# --- tool_choice -> grammar -----------------------------------------------------------------------------------
def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_named_function_is_forced_by_its_parameters_schema():
    plan = tool_plan(chat_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                     "")
    assert plan.grammar.kind == "json_schema"
    assert json.loads(plan.grammar.spec) == TOOLS[0]["function"]["parameters"]


def test_required_is_forced_to_an_array_of_calls_to_the_tools():
    spec = json.loads(tool_plan(chat_request(tools=TOOLS, tool_choice="required"), "").grammar.spec)
    assert spec["type"] == "array" and spec["minItems"] == 1
    assert [option["properties"]["name"]["enum"] for option in spec["items"]["anyOf"]] == [["get_weather"],
                                                                                           ["get_time"]]
    assert spec["$defs"] == {"z": {"type": "string"}}
    assert "$defs" not in spec["items"]["anyOf"][1]["properties"]["parameters"]
    assert "maxItems" not in spec


def test_required_without_parallel_calls_is_forced_to_one_call():
    plan = tool_plan(chat_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "")
    assert json.loads(plan.grammar.spec)["maxItems"] == 1


@pytest.mark.parametrize("fields, reason", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser"),
    ({"tools": TOOLS}, "--tool-call-parser"),
])
def test_tool_choices_that_cannot_be_served_are_refused_with_the_reason(fields, reason):
    with pytest.raises(APIError) as refused:
        tool_plan(chat_request(**fields), "")
    assert refused.value.status == 400 and reason in refused.value.message


def test_auto_uses_the_format_the_chat_template_shows_unless_a_flag_says():
    assert detect_parser("", "{{ '<tool_call>' }}") == "hermes"
    assert detect_parser("", "{% if message.role == 'ipython' %}") == "llama3_json"
    assert detect_parser("llama3_json", "{{ '<tool_call>' }}") == "llama3_json"
    assert detect_parser("", "{{ messages }}") == ""
    assert tool_plan(chat_request(tools=TOOLS, tool_choice="none"), "").parser is None


MODEL = ServedModel("tiny", "", tokenizer=None)   # no logprobs asked: its tokenizer is not needed


# --- responses ------------------------------------------------------------------------------------------------
def chat_format(parser: str, **fields) -> ChatFormat:
    return ChatFormat("chatcmpl-1", MODEL, False, tools=tool_plan(chat_request(tools=TOOLS, **fields), parser))


def test_a_whole_response_carries_the_calls_and_finishes_with_tool_calls():
    choice = Choice(0, HERMES_TEXT, finish_reason="stop")
    body = chat_format("hermes").body(Collected([choice]))
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me look that up.\n"
    assert names_and_arguments(message["tool_calls"]) == [("get_weather", WEATHER), ("get_time", TIME)]
    assert all(call["type"] == "function" for call in message["tool_calls"])


def test_a_stream_sends_call_deltas_and_finishes_with_tool_calls():
    fmt = chat_format("hermes")
    pieces = cuts(HERMES_TEXT, 4)
    responses = [router_pb2.GenerateResponse(text=piece) for piece in pieces]
    responses[-1].finish_reason = 2   # stop
    chunks = [c for c in (fmt.chunk(r) for r in responses) if c is not None]
    calls = CallsSoFar()
    for chunk in chunks:
        for piece in chunk["choices"][0]["delta"].get("tool_calls", []):
            calls.add(ParsedDelta(tool_calls=[parsed_piece(piece)]))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Let me look that up.\n"
    assert names_and_arguments(calls.calls) == [("get_weather", WEATHER), ("get_time", TIME)]


def parsed_piece(piece: dict) -> ToolCallDelta:
    function = piece["function"]
    return ToolCallDelta(piece["index"], piece.get("id"), function.get("name"), function["arguments"])


def test_without_tools_the_text_is_all_content():
    fmt = ChatFormat("chatcmpl-1", MODEL, False)
    body = fmt.body(Collected([Choice(0, HERMES_TEXT, finish_reason="stop")]))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": HERMES_TEXT}
    assert body["choices"][0]["finish_reason"] == "stop"


# --- the chat template ----------------------------------------------------------------------------------------
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for call in m.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% endif %}{% if m.role == 'tool' %} ({{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module")
def hermes_tokenizer_dir(tmp_path_factory):
    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("hermes-tokenizer")
    build_tiny_tokenizer(path, chat_template=HERMES_TEMPLATE)
    return path


def test_tools_and_tool_messages_render_as_transformers_renders_them(hermes_tokenizer_dir):
    from transformers import AutoTokenizer

    chat = chat_request(messages=CONVERSATION, tools=TOOLS).chat()
    prompt = RouterTokenizer(str(hermes_tokenizer_dir)).render_chat(*chat_template_inputs(chat))
    as_transformers = [dict(m) for m in CONVERSATION]
    as_transformers[1] = {**CONVERSATION[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    expected = AutoTokenizer.from_pretrained(hermes_tokenizer_dir).apply_chat_template(
        as_transformers, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert prompt == expected
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in prompt and "(call_1)" in prompt


def test_chat_tools_that_are_not_json_are_refused():
    with pytest.raises(ValueError, match="not valid JSON"):
        chat_template_inputs(router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user")], tools="[{"))


# --- Mistral's [TOOL_CALLS] ---------------------------------------------------------------------------------------
MISTRAL_ARRAY = (f'Let me check.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}, '
                 f'{{"name": "get_time", "arguments": {json.dumps(TIME)}}}]')
MISTRAL_NAMED = f'Let me check.[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}[TOOL_CALLS]get_time[ARGS]{{}}'


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text, calls", [(MISTRAL_ARRAY, [("get_weather", WEATHER), ("get_time", TIME)]),
                                         (MISTRAL_NAMED, [("get_weather", WEATHER), ("get_time", {})])],
                         ids=["array", "named"])
def test_mistral_calls_in_either_form_reassemble_from_any_cut_of_the_stream(text, calls, seed):
    content, got, _ = streamed(MistralParser(), cuts(text, seed))
    assert content == "Let me check." and names_and_arguments(got) == calls
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)   # what Mistral's templates take back


@pytest.mark.parametrize("text", ["Plain answer.", "a [TOOL] b [TOOL_CALL", "[1, 2] is a list"])
def test_mistral_text_without_the_marker_stays_content(text):
    for seed in range(3):
        assert streamed(MistralParser(), cuts(text, seed))[:2] == (text, [])


def test_mistral_call_cut_off_by_max_tokens_keeps_what_arrived():
    _, calls, _ = streamed(MistralParser(), ['[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'])
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


def test_the_mistral_parser_keeps_special_tokens_in_the_text_it_reads():
    assert tool_plan(chat_request(tools=TOOLS), "mistral").keeps_special_tokens
    assert not tool_plan(chat_request(tools=TOOLS), "hermes").keeps_special_tokens
    assert detect_parser("", "{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
