"""A chat request's messages and tools (router.proto's ChatMessages) as transformers' apply_chat_template takes
them: assistant tool calls with their arguments as dicts, tool results with their call's id."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from protos import router_pb2

# the variables Ferry gives the template itself: a request names them in their own fields, not in its kwargs
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                         "bos_token", "eos_token", "chat_template", "tokenize"})


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat's prompt is rendered beyond its messages and tools (vLLM's chat request extensions)."""
    variables: dict = field(default_factory=dict)   # chat_template_kwargs: enable_thinking, say
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def chat_template_inputs(chat: router_pb2.ChatMessages) -> tuple[list[dict], list[dict] | None, TemplateOptions]:
    """The messages, tools and options a chat template takes, as transformers' apply_chat_template gets them."""
    tools = parsed_json(chat.tools, list, "chat tools", "a JSON list") if chat.tools else None
    variables = template_variables(chat.template_kwargs, "chat_template_kwargs")
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    options = TemplateOptions(variables, add_generation_prompt, chat.continue_final_message)
    return [template_message(m) for m in chat.messages], tools, options


def template_variables(text: str, what: str) -> dict:
    """A JSON object of further variables for the template (empty text: none); ValueError naming `what` for one
    that is not, or that sets a variable Ferry gives the template itself."""
    variables = parsed_json(text, dict, what, "a JSON object") if text else {}
    if reserved := sorted(RESERVED_TEMPLATE_VARIABLES & variables.keys()):
        raise ValueError(f"{what} may not set {', '.join(reserved)}: the request's own fields do")
    return variables


def parsed_json(text: str, kind: type, what: str, shape: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not valid JSON ({e})") from e
    if not isinstance(value, kind):
        raise ValueError(f"{what}: must be {shape}")
    return value


def chat_chars(chat: router_pb2.ChatMessages) -> int:
    """The characters of text a chat holds (roles, contents, tool calls, tools, template variables): what its
    prompt grows with."""
    return len(chat.tools) + len(chat.template_kwargs) + sum(
        len(m.role) + len(m.content) + len(m.name) + len(m.tool_call_id)
        + sum(len(call.name) + len(call.arguments) for call in m.tool_calls) for m in chat.messages)


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
