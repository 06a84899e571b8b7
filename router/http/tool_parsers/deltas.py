"""What a tool parser answers each text delta with: the content the user may see now and OpenAI's tool-call pieces
(and, from the reasoning parser before it, the thinking)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    reasoning: str = ""     # a reasoning model's thinking, before its content (router/http/reasoning.py)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.reasoning)

    def merge(self, later: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(self.content + later.content, self.tool_calls + later.tool_calls,
                           self.reasoning + later.reasoning)
