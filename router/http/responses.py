"""OpenAI's Responses API (POST /v1/responses), as vLLM serves it: the request becomes a chat (instructions as
the system message, input items as messages, function calls and their outputs as tool calls and tool messages,
`text.format` as response_format) and runs as one; its answer comes back as output items (reasoning, the message,
function calls) whole or as the API's typed stream events. Responses are not stored: `store` is answered false and
`previous_response_id` refused, as vLLM does without its response store."""
from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from protos import router_pb2
from router.http.errors import api_error
from router.http.formats import ChatFormat
from router.http.formats import usage_json as chat_usage
from router.http.schema import SWITCH, TOP_LOGPROBS, UINT32, ChatCompletionRequest, RequestFields

TEXT_PARTS = ("input_text", "output_text", "text")


class ContentPartIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class InputItem(BaseModel):
    """One item of `input`: a message (its type may be left out), a function call the model made, that call's
    output, or a reasoning item (not rendered: chat templates leave earlier turns' thinking out)."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPartIn] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPartIn] | None = None

    def problem(self) -> tuple[str, str] | None:
        """(the field, what is wrong) for an item that cannot become a chat message."""
        if self.type == "message" and self.role is None:
            return "role", "a message needs a role: user, assistant, system or developer"
        if self.type == "function_call" and not (self.call_id and self.name):
            return "call_id", "a function_call item needs its call_id and name"
        if self.type == "function_call_output" and not self.call_id:
            return "call_id", "a function_call_output item needs the call_id it answers"
        for name in ("content", "output"):
            parts = getattr(self, name)
            if isinstance(parts, list) and any(part.type not in TEXT_PARTS for part in parts):
                return name, "only text content parts (input_text, output_text) are supported"
        return None


def joined(parts: str | list[ContentPartIn] | None) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    return "".join(part.text or "" for part in parts)


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = ""
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(RequestFields):
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: UINT32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: SWITCH = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: SWITCH = False
    top_logprobs: TOP_LOGPROBS | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.previous_response_id is not None:
            return "previous_response_id", ("responses are not stored here: send the conversation so far as "
                                            "`input`")
        if self.background:
            return "background", "background responses are not supported: responses are not stored here"
        if self.top_logprobs:
            return "top_logprobs", "logprobs are not supported on /v1/responses: use /v1/chat/completions"
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function" or not tool.name:
                return f"tools[{i}]", "only function tools (with a name) are supported"
        if isinstance(self.input, list):
            for i, item in enumerate(self.input):
                if problem := item.problem():
                    return f"input[{i}].{problem[0]}", problem[1]
        return None

    def messages(self) -> list[dict[str, Any]]:
        """The chat this request is: instructions first, as the system message; consecutive function calls as one
        assistant message's tool calls (after the assistant's text where it came just before)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if item.type == "message":
                messages.append({"role": item.role, "content": joined(item.content)})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or "{}"}}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": joined(item.output)})
        return messages

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (pydantic errors in its fields as any body's)."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": self.stream,
                                  "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "priority": self.priority, "cache_salt": self.cache_salt,
                                  "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format.type != "text":
            fields["response_format"] = response_format(self.text.format)
        return ChatCompletionRequest.model_validate(fields)

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": self.reasoning or {"effort": None, "summary": None},
                "store": False, "temperature": self.temperature, "top_p": self.top_p,
                "text": {"format": (self.text.format if self.text else TextFormat()).model_dump(
                    by_alias=True, exclude_none=True, exclude_defaults=True) or {"type": "text"}},
                "tool_choice": tool_choice_json(self.tool_choice, bool(self.tools)),
                "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
                "truncation": "disabled", "user": self.user}


def response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.json_schema,
                                                   "strict": text_format.strict}}


def tool_choice_json(choice: str | NamedFunctionChoice | None, has_tools: bool) -> str | dict[str, str]:
    if isinstance(choice, NamedFunctionChoice):
        return choice.model_dump()
    return choice or ("auto" if has_tools else "none")


# --- output items: one shape for whole answers and streams -----------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str = "", status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str = "", status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [reasoning_text(text)] if status == "completed" else []}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def call_item(call_id: str, name: str, arguments: str = "", status: str = "completed") -> dict[str, Any]:
    return {"id": new_id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat usage's figures under the Responses API's names."""
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


@dataclass
class ResponseObject:
    """The response object of one request, in its states: created, then completed or incomplete."""
    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def json(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             finish_reason: str | None = None) -> dict[str, Any]:
        cut_short = finish_reason == "length"
        if status == "completed" and cut_short:
            status = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if cut_short else None,
                "model": self.model, "output": output, "usage": responses_usage(usage), **self.request.echoed()}

    def whole(self, chat_body: dict[str, Any]) -> dict[str, Any]:
        """The answer of a chat completion's body (one choice) as this response."""
        choice = chat_body["choices"][0]
        message = choice["message"]
        output = [reasoning_item(message["reasoning"])] if message.get("reasoning") else []
        if message.get("content") or not message.get("tool_calls"):
            output.append(message_item(message.get("content") or ""))
        output += [call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
                   for call in message.get("tool_calls") or []]
        return self.json("completed", output, chat_body.get("usage"), choice["finish_reason"])


@dataclass
class EventStream:
    """A streamed response's typed events, each numbered, from the chat deltas of its one sample: an output item
    is opened when the first delta of its kind comes and closed when another kind's does, or at the end."""
    response: ResponseObject
    output: list[dict[str, Any]] = field(default_factory=list)   # the items so far; the last one may be open
    open: dict[str, Any] | None = None
    sequence: itertools.count = field(default_factory=itertools.count)

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = orjson.dumps({"type": kind, "sequence_number": next(self.sequence), **fields})
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    def opening(self) -> list[bytes]:
        state = self.response.json("in_progress", [])
        return [self.event("response.created", response=state), self.event("response.in_progress", response=state)]

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        events = []
        if delta.get("reasoning"):
            events += self.text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self.text("message", delta["content"])
        for piece in delta.get("tool_calls") or []:
            events += self.call_piece(piece)
        return events

    def text(self, kind: str, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            events += self.add(message_item(status="in_progress") if kind == "message"
                               else reasoning_item(status="in_progress"))
            part = output_text("") if kind == "message" else reasoning_text("")
            events.append(self.event("response.content_part.added", **self.where(), part=part))
            self.open["content"].append(part)
        self.open["content"][0]["text"] += text
        if kind == "message":
            return [*events, self.event("response.output_text.delta", **self.where(), delta=text, logprobs=[])]
        return [*events, self.event("response.reasoning_text.delta", **self.where(), delta=text)]

    def call_piece(self, piece: dict[str, Any]) -> list[bytes]:
        events = []
        arguments = piece["function"].get("arguments") or ""
        if "id" in piece:   # a call's first piece
            events += self.close()
            events += self.add(call_item(piece["id"], piece["function"]["name"], status="in_progress"))
        self.open["arguments"] += arguments
        if arguments:
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output) - 1, delta=arguments))
        return events

    def add(self, item: dict[str, Any]) -> list[bytes]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def close(self) -> list[bytes]:
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=len(self.output) - 1, name=item["name"],
                                     arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self.event("response.output_text.done", **self.where(), text=part["text"],
                                         logprobs=[]))
            else:
                events.append(self.event("response.reasoning_text.done", **self.where(), text=part["text"]))
            events.append(self.event("response.content_part.done", **self.where(), part=part))
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=len(self.output) - 1, item=item))
        self.open = None
        return events

    def ending(self, usage: dict[str, Any] | None, finish_reason: str | None) -> list[bytes]:
        events = self.close()
        final = self.response.json("completed", self.output, usage, finish_reason)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=final)]

    def error(self, error: Exception) -> bytes:
        return self.event("error", **api_error(error).body()["error"])


async def response_events(responses: AsyncIterator[router_pb2.GenerateResponse], fmt: ChatFormat,
                          stream: EventStream) -> AsyncIterator[bytes]:
    """The request's response stream as the Responses API's events: fmt reads reasoning and tool calls out of the
    text as a streamed chat would."""
    for event in stream.opening():
        yield event
    finish_reason = None
    async with contextlib.aclosing(responses):
        try:
            async for response in responses:
                chunk = fmt.chunk(response)
                if chunk is None or not chunk["choices"]:
                    continue
                choice = chunk["choices"][0]
                for event in stream.delta(choice["delta"]):
                    yield event
                finish_reason = choice["finish_reason"] or finish_reason
        except Exception as e:    # the status line has gone out: the error travels as an event
            yield stream.error(e)
            return
    for event in stream.ending(chat_usage(fmt.usage), finish_reason):
        yield event
