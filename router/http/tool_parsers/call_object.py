"""One call's JSON object, read a character at a time as the model writes it."""
from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")


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
