"""Incremental detokenization of one sample with stop strings.

Each step decodes only a short window of trailing tokens (vLLM's prefix_offset / read_offset): the window's
leading tokens (already read) give the context a tokenizer needs to render the new ones (a leading space, a
byte-level character split across tokens), and the text beyond their own decode is the new text. Text is
committed once it does not end in U+FFFD (a multi-byte character still being built). The final step decodes
the whole sample once, so deltas concatenate to exactly the full decode for every tokenizer. Text is held back
while its tail could be the start of a stop string.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class TextDelta:
    text: str
    stop_string: str | None = None     # set when a stop string matched: the sample is finished


def held_back_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


@dataclass
class IncrementalDetokenizer:
    decode: Callable[[list[int]], str]
    stops: tuple[str, ...] = ()
    include_stop_str: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""             # decode(token_ids[:read_offset]), kept only with stop strings
    prefix_offset: int = 0     # token_ids[prefix_offset:read_offset]: read tokens, decoded again as context
    read_offset: int = 0
    prefix_text: str = ""      # decode(token_ids[prefix_offset:read_offset])
    num_sent: int = 0          # characters of text sent so far

    def add(self, new_token_ids: list[int], final: bool = False) -> TextDelta:
        self.token_ids.extend(new_token_ids)
        if final:
            return self.finish(self.decode(self.token_ids))
        new_text, committed = self.decode_new_tokens()
        if not self.stops:   # nothing is held back: what the new tokens completed is all of the delta
            return self.emit_new(new_text if committed else "")
        text = self.text + new_text
        if committed:
            self.text = text
        match = self.find_stop(text)
        if match is not None:
            return self.finish(text, match)
        if text.endswith(REPLACEMENT_CHAR):
            return TextDelta("")
        return self.emit(text[:len(text) - held_back_length(text, self.stops)])

    def finish(self, text: str, match: tuple[int, str] | None = None) -> TextDelta:
        """The last delta: up to the stop string that matched first (in text, or in the final text), or all."""
        match = match or self.find_stop(text)
        if match is None:
            return self.emit(text)
        start, stop = match
        end = start + len(stop) if self.include_stop_str else start
        return self.emit(text[:end], stop)

    def add_until_stop(self, new_token_ids: list[int], final: bool = False) -> tuple[TextDelta, int]:
        """add() for several tokens at once (a client's pending tokens in one response), and how many of them
        count: with stop strings they go in one at a time, so none after the token that completed a match does."""
        if not self.stops or len(new_token_ids) <= 1:
            return self.add(new_token_ids, final), len(new_token_ids)
        text = ""
        for used, token_id in enumerate(new_token_ids, 1):
            delta = self.add([token_id], final and used == len(new_token_ids))
            text += delta.text
            if delta.stop_string is not None:
                return TextDelta(text, delta.stop_string), used
        return TextDelta(text), len(new_token_ids)

    def decode_new_tokens(self) -> tuple[str, bool]:
        """The text the tokens after read_offset add, decoding only the window from prefix_offset, and whether it
        was committed (the offsets moved on): not while it ends in U+FFFD."""
        window = self.decode(self.token_ids[self.prefix_offset:])
        new_text = window[len(self.prefix_text):]
        if not new_text or window.endswith(REPLACEMENT_CHAR):
            return new_text, False
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        return new_text, True

    def find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            # text before num_sent - len(stop) + 1 was checked already (nothing sent can start a stop string)
            index = text.find(stop, max(0, self.num_sent - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def emit(self, upto: str, stop: str | None = None) -> TextDelta:
        return self.emit_new(upto[self.num_sent:], stop)

    def emit_new(self, delta: str, stop: str | None = None) -> TextDelta:
        self.num_sent += len(delta)
        return TextDelta(delta, stop)
