"""`tools` and `tool_choice` on /v1/chat/completions, as vLLM serves them: "required" and a named function are
forced by a grammar on the output (through the structured-output core), "auto" is read from the model's own
tool-call format, and the calls come back in OpenAI's message and stream-delta shapes."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from base.structured_output import StructuredOutput
from protos import common_pb2
from router.http.errors import APIError
from router.http.schema import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from router.http.tool_parsers import (PARSERS, CallArrayParser, NamedCallParser, ParsedDelta, ToolCallDelta,
                                     ToolParser)

NO_ARGUMENTS = {"type": "object", "properties": {}}
# what in a chat template tells which format its model calls tools in, as vLLM users pick --tool-call-parser
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"),
                    ("[TOOL_CALLS]", "mistral"))

ParserFactory = Callable[[], ToolParser]


def detect_parser(flag: str, chat_template: str | None) -> str:
    """The router's --tool-call-parser, else the format the chat template shows; "" when neither says."""
    if flag:
        return flag
    return next((name for marker, name in TEMPLATE_MARKERS if marker in (chat_template or "")), "")


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output relates to its tools: the grammar forcing a call, the parser reading calls."""
    grammar: StructuredOutput | None = None
    parser: ParserFactory | None = None     # none: the text is all content

    @property
    def calls_tools(self) -> bool:
        return self.parser is not None

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser reads a special token (Mistral's [TOOL_CALLS]), which the text must keep."""
        return getattr(self.parser, "keeps_special_tokens", False)


def tool_plan(body: ChatCompletionRequest, parser_name: str) -> ToolPlan:
    """Raises APIError (400) with the reason for a tool_choice that cannot be served."""
    if body.tool_choice is not None and not body.tools:
        raise APIError(400, "tool_choice needs tools: give the functions it may call", param="tool_choice")
    choice = body.effective_tool_choice
    if choice == "none":
        return ToolPlan()
    tools = body.tools or []
    if isinstance(choice, NamedToolChoice):
        tool = named_tool(tools, choice.function.name)
        return ToolPlan(json_schema(parameters_schema(tool)), lambda: NamedCallParser(name=tool.function.name))
    if choice == "required":
        return ToolPlan(json_schema(call_array_schema(tools, one_call=body.parallel_tool_calls is False)),
                        CallArrayParser)
    if parser_name not in PARSERS:
        raise APIError(400, '"auto" tool choice needs to know the model\'s tool-call format, which its chat '
                            'template does not show: start the router with --tool-call-parser '
                            f'{{{",".join(sorted(PARSERS))}}}, or send tool_choice "required" or a named function',
                       param="tool_choice")
    return ToolPlan(parser=PARSERS[parser_name])


def named_tool(tools: list[ToolDefinition], name: str) -> ToolDefinition:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools "
                        f"({', '.join(t.function.name for t in tools)})", param="tool_choice")


def parameters_schema(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters else NO_ARGUMENTS


def call_array_schema(tools: list[ToolDefinition], one_call: bool = False) -> dict[str, Any]:
    """vLLM's grammar for "required": one or more {"name": <a tool>, "parameters": <that tool's schema>} (just one
    with parallel_tool_calls false), the tools' $defs gathered at the top so their references still resolve."""
    definitions: dict[str, Any] = {}
    calls = []
    for tool in tools:
        schema = dict(parameters_schema(tool))
        for name, definition in schema.pop("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise APIError(400, f"tools define $defs {name!r} differently; give each definition its own name",
                               param="tools")
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": schema},
                      "required": ["name", "parameters"]})
    array = {"type": "array", "minItems": 1, **({"maxItems": 1} if one_call else {}),
             "items": {"type": "object", "anyOf": calls}}
    return {**array, "$defs": definitions} if definitions else array


def json_schema(schema: dict[str, Any]) -> StructuredOutput:
    try:
        return StructuredOutput("json_schema", json.dumps(schema))
    except ValueError as e:
        raise APIError(400, f"tool parameters: {e}", param="tools") from e


@dataclass
class CallsSoFar:
    """One sample's tool calls, assembled from the deltas the parser gave."""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, delta: ParsedDelta) -> None:
        for piece in delta.tool_calls:
            if piece.index == len(self.calls):
                self.calls.append({"id": piece.id, "type": "function",
                                   "function": {"name": piece.name, "arguments": ""}})
            self.calls[piece.index]["function"]["arguments"] += piece.arguments


def parse_whole(parser: ToolParser, text: str) -> tuple[str, list[dict[str, Any]]]:
    """A finished sample's content and tool calls."""
    delta = parser.feed(text).merge(parser.finish())
    calls = CallsSoFar()
    calls.add(delta)
    return delta.content, calls.calls


def delta_json(delta: ParsedDelta) -> dict[str, Any]:
    """A stream chunk's `delta`: the reasoning, the content, and tool-call pieces (id, type and name on a call's
    first)."""
    out: dict[str, Any] = {"reasoning": delta.reasoning} if delta.reasoning else {}
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [call_delta_json(c) for c in delta.tool_calls]
    return out


def call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a sample that ended by calling; a cut-off one stays "length"."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def add_grammar(plan: ToolPlan, sampling: common_pb2.SamplingParams) -> None:
    """The tool choice's grammar on the request; it cannot share the output with another constraint."""
    if plan.grammar is None:
        return
    if sampling.HasField("structured_output"):
        raise APIError(400, 'tool_choice "required" or a named function already constrains the output: '
                            "drop response_format (or the other structured output)", param="tool_choice")
    sampling.structured_output.CopyFrom(plan.grammar.to_proto())
