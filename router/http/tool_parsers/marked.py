"""The formats models are trained on, where calls follow a marker in the content: Hermes' `<tool_call>` and Llama 3's
`<|python_tag|>` (or bare JSON at the start)."""
from __future__ import annotations

from dataclasses import dataclass

from router.http.tool_parsers.parser import ToolParser


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

    def step_outside_call(self) -> bool:
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
        self.after_marker()
        return True

    def after_marker(self) -> None:
        """The marker is read: a call follows (its text given back as content if it is no call after all)."""
        self.open_call(self.start)
        self.state = "call"

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

    def step_outside_call(self) -> bool:
        if self.state == "opening":
            return self.opening()
        return super().step_outside_call()

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
