"""A Responses API request as the chat it runs as (router/http/responses.py): instructions first as the system
message, a model's function calls as one assistant message's tool calls, their outputs as tool messages, reasoning
items left out, `text.format` as response_format and a named tool_choice in the chat's shape."""
from __future__ import annotations

from router.http.responses import ResponsesRequest

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def chat_call(call_id: str, city: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


def test_calls_join_the_assistant_message_before_them_and_outputs_become_tool_messages():
    request = ResponsesRequest(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "two cities"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        CALL, {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21 C"}]},
    ])
    assert request.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [chat_call("call_1", "Paris"),
                                                                     chat_call("call_2", "Rome")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21 C"},
    ]


def test_a_call_with_no_assistant_text_before_it_is_an_assistant_message_of_its_own():
    request = ResponsesRequest(input=[{"role": "user", "content": "Weather?"}, CALL])
    assert request.messages()[1] == {"role": "assistant", "content": None,
                                     "tool_calls": [chat_call("call_1", "Paris")]}


def test_text_format_and_a_named_tool_choice_take_the_chats_shapes():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    chat = ResponsesRequest(input="hi", text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
                            tools=[{"type": "function", "name": "get_weather", "parameters": schema}],
                            tool_choice={"type": "function", "name": "get_weather"},
                            max_output_tokens=7).chat_request()
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.json_schema == schema
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == schema
    assert chat.tool_choice.function.name == "get_weather" and chat.requested_max_tokens == 7
    assert chat.messages[0].role == "user" and chat.messages[0].text() == "hi"
