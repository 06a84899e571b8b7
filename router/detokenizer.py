"""Incremental detokenization of one sample with stop strings.

Each step decodes only a short window of trailing tokens (vLLM's prefix_offset / read_offset): the window's
leading tokens (already read) give the context a tokenizer needs to render the new ones (a leading space, a
byte-level character split across tokens), and the text beyond their own decode is the new text. Text is
committed once it does not end in U+FFFD (a multi-byte character still being built). Tokens that keep it ending so,
or add no text, are committed anyway once the tokens after them show that their text is final, so the window stays
short whatever the tokens decode to (a run of U+FFFD, of skipped special tokens). The final step decodes the whole
sample once, so deltas concatenate to exactly the full decode for every tokenizer. Text is held back while its
tail could be the start of a stop string.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

REPLACEMENT_CHAR = "\ufffd"
SETTLE_AFTER_TOKENS = 3   # a UTF-8 character has at most 4 bytes: 3 tokens after a cut show whether it split one


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
    context: list[int] = field(default_factory=list)   # read tokens decoded again before the unread ones
    context_text: str = ""     # decode(context)
    read_offset: int = 0       # token_ids[read_offset:]: not read yet (their text is not committed)
    num_sent: int = 0          # characters of text sent so far

    def add(self, new_token_ids: list[int], final: bool = False) -> TextDelta:
        self.token_ids.extend(new_token_ids)
        if final:
            return self.finish(self.decode(self.token_ids))
        committed, pending = self.decode_new_tokens()
        if not self.stops:   # nothing is held back: what the new tokens completed is all of the delta
            return self.emit_new(committed)
        self.text += committed
        text = self.text + pending   # a stop string may end in pending text; the rest of it is sent once committed
        match = self.find_stop(text)
        if match is not None:
            return self.finish(text, match)
        return self.emit(self.text[:len(self.text) - held_back_length(self.text, self.stops)])

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

    def decode_new_tokens(self) -> tuple[str, str]:
        """The text the unread tokens add, decoding only them after the context: the part committed (read: the
        offsets moved on past it) and the part still pending (a character may be being built)."""
        window = self.decode(self.context + self.token_ids[self.read_offset:])
        new_text = window[len(self.context_text):]
        if new_text and not window.endswith(REPLACEMENT_CHAR):
            self.context = self.token_ids[self.read_offset:]
            self.context_text, self.read_offset = self.decode(self.context), len(self.token_ids)
            return new_text, ""
        if len(self.token_ids) - self.read_offset > SETTLE_AFTER_TOKENS:
            committed = self.read_settled_tokens(window)
            return committed, new_text[len(committed):]
        return "", new_text

    def read_settled_tokens(self, window: str) -> str:
        """Read all but the last SETTLE_AFTER_TOKENS tokens if the window starts with their text and the tokens
        after them read the same after the next context; their new text."""
        settled = len(self.token_ids) - SETTLE_AFTER_TOKENS
        text = self.decode(self.context + self.token_ids[self.read_offset:settled])
        if not (text.startswith(self.context_text) and window.startswith(text)):
            return ""
        new_text = text[len(self.context_text):]
        context = self.next_context(new_text, settled)
        if context is None or not self.reads_the_same(*context, settled, window[len(text):],
                                                      text.endswith(REPLACEMENT_CHAR)):
            return ""
        (self.context, self.context_text), self.read_offset = context, settled
        return new_text

    def next_context(self, new_text: str, settled: int) -> tuple[list[int], str] | None:
        """The context after reading up to `settled`: the tokens read, if their text builds up token by token (byte
        fallback renders a byte by the whole run of bytes it is in); the context as it was if they add no text
        (special tokens the decoder skips); None if neither."""
        if not new_text:
            return self.context, self.context_text
        context = self.token_ids[self.read_offset:settled]
        texts = [self.decode(context[:end]) for end in range(1, len(context) + 1)]
        if not texts[-1] or not all(texts[-1].startswith(part) for part in texts[:-1]):
            return None   # empty: a context whose text a decoder strips (a leading space) is no context
        return context, texts[-1]

    def reads_the_same(self, context: list[int], context_text: str, settled: int, unread_text: str,
                       after_replacement: bool) -> bool:
        """Whether the tokens from `settled` on render after the context as they do in the window (unread_text),
        token by token: each decode starts with the context's text (no character is being built across it) and,
        after a U+FFFD, adds text of its own (so that U+FFFD is final: no character was being built there)."""
        unread = self.token_ids[settled:]
        texts = [context_text] + [self.decode(context + unread[:end]) for end in range(1, len(unread) + 1)]
        grows = not after_replacement or all(len(a) < len(b) for a, b in pairwise(texts))
        return grows and all(t.startswith(context_text) for t in texts) and texts[-1] == context_text + unread_text

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
