"""Incremental detokenization of one sample with stop strings.

Deltas concatenate to exactly the final text: each call decodes the sample's tokens and emits what lies beyond
the text already sent. Text is held back while the decode ends in U+FFFD (a multi-byte character still being
built) and while its tail could be the start of a stop string.
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
    sent: str = ""

    def add(self, new_token_ids: list[int], final: bool = False) -> TextDelta:
        self.token_ids.extend(new_token_ids)
        text = self.decode(self.token_ids)
        match = self.find_stop(text)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str else start
            return self.emit(text[:end], stop)
        if final:
            return self.emit(text)
        if text.endswith(REPLACEMENT_CHAR):
            return TextDelta("")
        return self.emit(text[:len(text) - held_back_length(text, self.stops)])

    def find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            # text before len(sent) - len(stop) + 1 was checked already (nothing sent can start a stop string)
            index = text.find(stop, max(0, len(self.sent) - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def emit(self, upto: str, stop: str | None = None) -> TextDelta:
        if not upto.startswith(self.sent):   # a decode that rewrote sent text: send only what is new
            delta = upto[len(self.sent):] if len(upto) > len(self.sent) else ""
        else:
            delta = upto[len(self.sent):]
        self.sent += delta
        return TextDelta(delta, stop)
