"""A reasoning model's thinking read out of its chat output, as vLLM's --reasoning-parser reads it: the text inside
`<think>...</think>` is the message's `reasoning`, what follows is its content (and goes on to the tool parser).

Two models' conventions, by vLLM's parser names:
- deepseek_r1 (DeepSeek-R1, QwQ, Qwen3's thinking-only releases): the template opens `<think>` in the prompt, so the
  output is reasoning from its start (a `<think>` it repeats is dropped) until `</think>`; never closed, all of it is.
- qwen3 (Qwen3's hybrid models): the output is reasoning only if it opens with `<think>`; with
  `chat_template_kwargs: {"enable_thinking": false}` it does not, and all of it is content.
Streamed, the split is the same as on the whole text: text that may still be half a tag is held back until known.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.http.tool_parsers.marked import held_prefix

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningParser:
    """One sample's text, split into (reasoning, content) pieces as it streams."""
    thinks_from_start: bool
    state: str = "opening"     # opening (the first characters), thinking, answering
    buffer: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        if self.state == "opening" and not self.opened():
            return "", ""
        if self.state == "thinking":
            return self.think()
        shown, self.buffer = self.buffer, ""
        return "", shown

    def finish(self) -> tuple[str, str]:
        """What was held back, once the sample has ended."""
        held, self.buffer = self.buffer, ""
        thinking = self.state == "thinking" or (self.state == "opening" and self.thinks_from_start)
        return (held, "") if thinking else ("", held)

    def opened(self) -> bool:
        """Whether the output's start has told thinking from answering (else it may still open with <think>)."""
        start = self.buffer.lstrip()
        if start.startswith(THINK_START):
            self.buffer = start[len(THINK_START):]
            self.state = "thinking"
            return True
        if THINK_START.startswith(start):
            return False
        self.state = "thinking" if self.thinks_from_start else "answering"
        return True

    def think(self) -> tuple[str, str]:
        at = self.buffer.find(THINK_END)
        if at >= 0:
            reasoning, content = self.buffer[:at], self.buffer[at + len(THINK_END):]
            self.buffer, self.state = "", "answering"
            return reasoning, content
        keep = held_prefix(self.buffer, THINK_END)
        reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return reasoning, ""


ReasoningFactory = Callable[[], ReasoningParser]
REASONING_PARSERS: dict[str, ReasoningFactory] = {
    "deepseek_r1": lambda: ReasoningParser(thinks_from_start=True),
    "qwen3": lambda: ReasoningParser(thinks_from_start=False),
}


def split_whole(parser: ReasoningParser, text: str) -> tuple[str, str]:
    """A finished sample's reasoning and content."""
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return reasoning + more_reasoning, content + more_content
