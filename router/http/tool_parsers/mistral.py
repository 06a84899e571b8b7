"""Mistral's tool calls, after its `[TOOL_CALLS]` token: a JSON array of {"name", "arguments"} (tokenizers before
v11: Mistral 7B v0.3, Mixtral 8x22B), or each call as `name[ARGS]{...}` (v11 on: Mistral Small 3.x, Devstral).
The token is a special one, which detokenizing leaves out by default: the request keeps special tokens in its text
while this parser reads it (`keeps_special_tokens`), as vLLM's does. Call ids are 9 letters and digits, the only ones
Mistral's chat templates take back."""
from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from typing import ClassVar

from router.http.tool_parsers.marked import MarkedCallParser

ID_CHARACTERS = string.ascii_letters + string.digits


@dataclass
class MistralParser(MarkedCallParser):
    start: str = "[TOOL_CALLS]"
    args_tag: str = "[ARGS]"
    form: str = ""   # "array" or "named", once the text after the first marker shows it
    keeps_special_tokens: ClassVar[bool] = True

    def new_call_id(self) -> str:
        return "".join(random.choices(ID_CHARACTERS, k=9))

    def after_marker(self) -> None:
        self.state = "marked"

    def step_outside_call(self) -> bool:
        if self.state == "marked":
            return self.read_form()
        if self.state == "in_array" or (self.state == "after_call" and self.form == "array"):
            return self.between_array_calls()
        if self.state == "named":
            return self.read_name()
        return self.read_text()

    def read_form(self) -> bool:
        text = self.buffer.lstrip()
        if not text:
            self.buffer = ""
            return False
        self.form = "array" if text.startswith("[") else "named"
        self.buffer, self.state = (text[1:], "in_array") if self.form == "array" else (text, "named")
        return True

    def between_array_calls(self) -> bool:
        """Inside the array: a call, a comma, or its end (after which any text is content again)."""
        text = self.buffer.lstrip()
        self.state = "in_array"
        if not text:
            self.buffer = ""
            return False
        if text.startswith(","):
            self.buffer = text[1:]
        elif text.startswith("{"):
            self.buffer = text
            self.open_call()
            self.state = "call"
        else:   # the closing bracket, or text that is no call
            self.buffer = text[1:] if text.startswith("]") else text
            self.state = "text"
        return True

    def read_name(self) -> bool:
        at = self.buffer.find(self.args_tag)
        if at < 0:
            return False   # the name is still coming
        name, self.buffer = self.buffer[:at].strip(), self.buffer[at + len(self.args_tag):]
        self.open_call()
        self.current.call.feed(f'{{"name": {json.dumps(name)}, "arguments": ')   # the arguments' object follows
        self.state = "call"
        return True

    def feed_call(self) -> bool:
        if self.form == "array":
            return super().feed_call()
        call = self.current.call   # the named form: the call ends with its arguments' object
        taken = 0
        while taken < len(self.buffer) and call.phase != "after_value":
            call.feed(self.buffer[taken])
            taken += 1
        self.buffer = self.buffer[taken:]
        if call.phase != "after_value":
            return False
        call.feed("}")
        self.close_call()
        self.state = "text"
        return True
