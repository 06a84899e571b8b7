"""The shapes a tool_choice grammar forces on the output: a JSON array of calls for "required", the arguments alone
for a named function."""
from __future__ import annotations

from dataclasses import dataclass

from router.http.tool_parsers.parser import ToolParser


@dataclass
class CallArrayParser(ToolParser):
    """tool_choice "required": a JSON array of {"name": ..., "parameters": {...}}, the shape its grammar forces."""
    state: str = "opening"

    def step_outside_call(self) -> bool:
        text = self.buffer.lstrip()
        if not text:
            self.buffer = ""
            return False
        if self.state == "opening" and text.startswith("["):
            self.buffer, self.state = text[1:], "after_call"   # as between calls: a call, a comma or the end
        elif self.state == "after_call" and text.startswith(","):
            self.buffer = text[1:]
        elif self.state == "after_call" and text.startswith("{"):
            self.buffer = text
            self.open_call()
            self.state = "call"
        else:   # the closing bracket, or text the grammar would not allow
            self.buffer, self.state = "", "closed"
            return False
        return True

    def end(self) -> None:
        self.close_unfinished_call()
        self.buffer = ""


@dataclass
class NamedCallParser(ToolParser):
    """A named tool_choice: the whole text is that function's arguments."""
    name: str = ""

    def step_outside_call(self) -> bool:
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
