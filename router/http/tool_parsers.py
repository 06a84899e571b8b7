"""Tool calls read out of generated text as it streams, in the formats models are trained on (Hermes'
`<tool_call>{...}</tool_call>`, Llama 3's bare JSON) and in the shapes a tool_choice grammar forces (a JSON array
of calls for "required", the arguments alone for a named function).

A parser is fed the text deltas of one sample and answers each with a ParsedDelta: the content the user may see
now and the tool-call pieces OpenAI's stream sends (a call's first piece carries its id and name, later ones more
of its arguments' JSON text). Text that may still turn out to open a call is held back until it is known.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None      # with the name, on a call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def merge(self, later: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(self.content + later.content, self.tool_calls + later.tool_calls)


@dataclass
class CallObject:
    """One JSON object {"name": ..., "arguments" | "parameters": ...} read a character at a time: its name once it
    is whole, its arguments' raw JSON text as it comes."""
    name: str | None = None
    arguments: str = ""
    has_arguments: bool = False
    done: bool = False
    text: str = ""             # everything read, for giving it back as content when it is no call after all
    depth: int = 0             # nesting of the value being read, inside the object
    phase: str = "open"        # open, key, colon, value_start, value, after_value
    key: str = ""
    token: str = ""
    in_string: bool = False
    escaped: bool = False
    streams_value: bool = False

    def feed(self, text: str) -> int:
        """Reads up to the object's closing brace; returns how many characters it took."""
        for i, char in enumerate(text):
            self.text += char
            self.read(char)
            if self.done:
                return i + 1
        return len(text)

    def read(self, char: str) -> None:
        if self.phase == "value":
            self.read_value(char)
        elif self.phase == "key" and self.in_string:
            self.token += char
            if self.string_closed(char):
                self.key, self.phase = json_string(self.token) or "", "colon"
        elif char.isspace():
            return
        elif self.phase == "open":
            self.phase = "key" if char == "{" else self.phase
        elif self.phase in ("key", "after_value") and char == "}":
            self.done = True
        elif self.phase == "key" and char == '"':
            self.token, self.in_string = char, True
        elif self.phase == "after_value" and char == ",":
            self.phase = "key"
        elif self.phase == "colon" and char == ":":
            self.phase = "value_start"
        elif self.phase == "value_start":
            self.start_value(char)

    def start_value(self, char: str) -> None:
        self.phase, self.token, self.depth = "value", "", 0
        self.streams_value = self.key in ARGUMENT_KEYS and char in '{["'
        if self.key in ARGUMENT_KEYS:
            self.has_arguments, self.arguments = True, ""
        self.read_value(char)

    def read_value(self, char: str) -> None:
        if self.in_string:
            self.take(char)
            if self.string_closed(char) and self.depth == 0:
                self.end_value()
            return
        if char == '"':
            self.take(char)
            self.in_string = True
        elif char in "{[":
            self.take(char)
            self.depth += 1
        elif char in "}]" and self.depth > 0:
            self.take(char)
            self.depth -= 1
            if self.depth == 0:
                self.end_value()
        elif char in ",}" and self.depth == 0:   # a number, true, false or null ends
            self.end_value()
            self.read(char)
        else:
            self.take(char)

    def take(self, char: str) -> None:
        self.token += char
        if self.streams_value:
            self.arguments += char

    def string_closed(self, char: str) -> bool:
        """Tracks escapes inside a string; true when this character closes it."""
        if self.escaped:
            self.escaped = False
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            self.in_string = False
            return True
        return False

    def end_value(self) -> None:
        value = self.token.strip()
        if self.key == "name":
            self.name = json_string(value) or None
        elif self.key in ARGUMENT_KEYS and not self.streams_value:
            self.arguments = value
        self.phase = "after_value"


def json_string(value: str) -> str | None:
    """The string a JSON string literal holds; None for anything else (a model may write broken escapes)."""
    try:
        text = json.loads(value)
    except json.JSONDecodeError:
        return None
    return text if isinstance(text, str) else None


@dataclass
class CallStream:
    """A call as the client has seen it: the id it was given and how much of its arguments were sent."""
    index: int
    call: CallObject
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str | None = None
    sent: int = 0
    announced: bool = False

    def delta(self, final: bool = False) -> ToolCallDelta | None:
        """What the client has not seen yet; at the end, a call that had no arguments gets "{}"."""
        name = self.name or self.call.name
        if name is None:
            return None
        if final and not self.call.has_arguments:
            self.call.arguments, self.call.has_arguments = "{}", True
        piece = self.call.arguments[self.sent:]
        if self.announced and not piece:
            return None
        self.sent += len(piece)
        first, self.announced = not self.announced, True
        return ToolCallDelta(self.index, self.id if first else None, name if first else None, piece)


@dataclass
class ToolParser:
    """The machinery the formats share: the text not yet placed, the calls so far, content after calls."""
    buffer: str = ""
    calls: list[CallStream] = field(default_factory=list)
    trailing: str = ""          # whitespace after a call, shown only if more content follows
    content: str = ""

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        while self.buffer and self.step():
            pass
        return self.drain()

    def finish(self) -> ParsedDelta:
        self.end()
        return self.drain(final=True)

    def step(self) -> bool:
        """Places some of the buffer; false when it must wait for more text."""
        raise NotImplementedError

    def end(self) -> None:
        """The text is complete: place what the buffer still holds."""
        if self.current is not None and not self.current.call.done:
            self.close_call()
        self.show(self.buffer)
        self.buffer = ""

    @property
    def current(self) -> CallStream | None:
        return self.calls[-1] if self.calls else None

    def open_call(self, prefix: str = "") -> None:
        self.calls.append(CallStream(len(self.calls), CallObject(text=prefix)))

    def feed_call(self) -> bool:
        """Gives the buffer to the open call; true when the call is complete."""
        call = self.current.call
        self.buffer = self.buffer[call.feed(self.buffer):]
        if call.done:
            self.close_call()
        return call.done

    def close_call(self) -> None:
        """A call without a name was no call: its text goes back to the content."""
        stream = self.current
        if stream.name is None and stream.call.name is None:
            self.calls.pop()
            self.show(stream.call.text)

    def show(self, text: str) -> None:
        if not self.calls:
            self.content += text
            return
        self.trailing += text
        if self.trailing.strip():
            self.content += self.trailing.lstrip()
            self.trailing = ""

    def drain(self, final: bool = False) -> ParsedDelta:
        deltas = [d for d in (c.delta(final) for c in self.calls) if d is not None]
        content, self.content = self.content, ""
        return ParsedDelta(content, deltas)


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of text could begin marker."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class MarkedCallParser(ToolParser):
    """Content with calls after a marker: `<tool_call>` for Hermes, `<|python_tag|>` for Llama 3."""
    start: str = ""
    state: str = "text"

    def step(self) -> bool:
        if self.state == "call":
            if self.feed_call():
                self.state = "after_call"
            return True
        if self.state == "after_call":
            return self.after_call()
        return self.read_text()

    def read_text(self) -> bool:
        at = self.buffer.find(self.start)
        if at < 0:
            keep = held_prefix(self.buffer, self.start)
            self.show(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        self.show(self.buffer[:at])
        self.buffer = self.buffer[at + len(self.start):]
        self.open_call(self.start)
        self.state = "call"
        return True

    def after_call(self) -> bool:
        self.state = "text"
        return True


@dataclass
class HermesParser(MarkedCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as the model makes."""
    start: str = "<tool_call>"
    end_tag: str = "</tool_call>"

    def after_call(self) -> bool:
        rest = self.buffer.lstrip()
        if not rest or (self.end_tag.startswith(rest) and rest != self.end_tag):
            return False
        self.buffer = rest[len(self.end_tag):] if rest.startswith(self.end_tag) else rest
        self.state = "text"
        return True


@dataclass
class Llama3JsonParser(MarkedCallParser):
    """Llama 3's JSON calls: `{"name": ..., "parameters": {...}}`, at the start or after `<|python_tag|>`,
    several separated by `;`."""
    start: str = "<|python_tag|>"
    state: str = "opening"

    def step(self) -> bool:
        if self.state == "opening":
            return self.opening()
        return super().step()

    def opening(self) -> bool:
        text = self.buffer.lstrip()
        if not text or (self.start.startswith(text) and text != self.start):
            return False
        self.state = "after_call" if text.startswith("{") else "text"
        return True

    def after_call(self) -> bool:
        rest = self.buffer.lstrip().lstrip(";").lstrip()
        if not rest:
            self.buffer = ""
            return False
        self.buffer = rest
        if rest.startswith("{"):
            self.open_call()
            self.state = "call"
        else:
            self.state = "text"
        return True


@dataclass
class CallArrayParser(ToolParser):
    """tool_choice "required": a JSON array of {"name": ..., "parameters": {...}}, the shape its grammar forces."""
    state: str = "opening"

    def step(self) -> bool:
        if self.state == "call":
            if self.feed_call():
                self.state = "between"
            return True
        text = self.buffer.lstrip()
        if not text:
            self.buffer = ""
            return False
        if self.state == "opening" and text.startswith("["):
            self.buffer, self.state = text[1:], "between"
        elif self.state == "between" and text.startswith(","):
            self.buffer = text[1:]
        elif self.state == "between" and text.startswith("{"):
            self.buffer = text
            self.open_call()
            self.state = "call"
        else:   # the closing bracket, or text the grammar would not allow
            self.buffer, self.state = "", "closed"
            return False
        return True

    def end(self) -> None:
        if self.current is not None and not self.current.call.done:
            self.close_call()
        self.buffer = ""


@dataclass
class NamedCallParser(ToolParser):
    """A named tool_choice: the whole text is that function's arguments."""
    name: str = ""

    def step(self) -> bool:
        if not self.calls:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self.open_call()
            self.current.name = self.current.call.name = self.name
            self.current.call.has_arguments = True
        self.current.call.arguments += self.buffer
        self.buffer = ""
        return False

    def end(self) -> None:
        self.buffer = ""


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
