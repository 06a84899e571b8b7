"""A chat request's messages and tools (router.proto's ChatMessages) as transformers' apply_chat_template takes
them: assistant tool calls with their arguments as dicts, tool results with their call's id."""
from __future__ import annotations

import json

from protos import router_pb2


def chat_template_inputs(chat: router_pb2.ChatMessages) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools a chat template takes, as transformers' apply_chat_template gets them."""
    try:
        tools = json.loads(chat.tools) if chat.tools else None
    except json.JSONDecodeError as e:
        raise ValueError(f"chat tools are not valid JSON: {e}") from e
    if tools is not None and not isinstance(tools, list):
        raise ValueError("chat tools must be a JSON list")
    return [template_message(m) for m in chat.messages], tools


def chat_chars(chat: router_pb2.ChatMessages) -> int:
    """The characters of text a chat holds (roles, contents, tool calls, tools): what its prompt grows with."""
    return len(chat.tools) + sum(len(m.role) + len(m.content) + len(m.name) + len(m.tool_call_id)
                                 + sum(len(call.name) + len(call.arguments) for call in m.tool_calls)
                                 for m in chat.messages)


def template_message(message: router_pb2.ChatMessage) -> dict:
    rendered: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": parsed_arguments(call.arguments)}}
                                  for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name:
        rendered["name"] = message.name
    return rendered


def parsed_arguments(arguments: str) -> dict | str:
    """Templates expect a call's arguments as a dict (transformers' rule, which vLLM follows); text that is not
    a JSON object stays text."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments
