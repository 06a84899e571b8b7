"""The machinery every tool-call format shares: the calls the client has seen so far, the text not yet placed, and
content that comes after calls."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import ClassVar

from router.http.tool_parsers.call_object import CallObject
from router.http.tool_parsers.deltas import ParsedDelta, ToolCallDelta


@dataclass
class CallStream:
    """A call as the client has seen it: the id it was given and how much of its arguments were sent."""
    index: int
    call: CallObject
    id: str = ""
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
    """A format's parser: `step_outside_call` places text between calls; inside a call the call object reads it."""
    buffer: str = ""
    calls: list[CallStream] = field(default_factory=list)
    trailing: str = ""          # whitespace after a call, shown only if more content follows
    content: str = ""
    state: str = "text"         # "call" while a call object reads the text, "after_call" once it is whole
    keeps_special_tokens: ClassVar[bool] = False   # its marker is a special token, which the text must keep

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
        if self.state != "call":
            return self.step_outside_call()
        if self.feed_call():
            self.state = "after_call"
        return True

    def step_outside_call(self) -> bool:
        raise NotImplementedError

    def end(self) -> None:
        """The text is complete: place what the buffer still holds."""
        self.close_unfinished_call()
        self.show(self.buffer)
        self.buffer = ""

    @property
    def current(self) -> CallStream | None:
        return self.calls[-1] if self.calls else None

    def open_call(self, prefix: str = "") -> None:
        self.calls.append(CallStream(len(self.calls), CallObject(text=prefix), self.new_call_id()))

    def new_call_id(self) -> str:
        """The id the client gets for a call (and sends back with its result)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def feed_call(self) -> bool:
        """Gives the buffer to the open call; true when the call is complete."""
        call = self.current.call
        self.buffer = self.buffer[call.feed(self.buffer):]
        if call.done:
            self.close_call()
        return call.done

    def close_unfinished_call(self) -> None:
        if self.current is not None and not self.current.call.done:
            self.close_call()

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
