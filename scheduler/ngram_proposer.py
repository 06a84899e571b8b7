"""Prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens.

Outputs that quote their prompt (code edits, retrieval answers, agents' tool calls) repeat long spans of it; once
the last few tokens match an earlier span, the tokens after that span are a good guess at what comes next. The
longest suffix is tried first (prompt_lookup_max down to prompt_lookup_min), and its latest occurrence wins.

Each sequence's tokens are kept packed, 4 bytes a token, extended as they grow: one lookup is a bytes.rfind over
them (C speed, no per-token index to hold).
"""
from __future__ import annotations

from array import array

from base.speculative import SpeculativeConfig
from scheduler.sequence import Sequence

TOKEN_BYTES = 4


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.packed: dict[str, bytearray] = {}   # seq_id -> its known tokens, packed

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens to follow seq's known tokens; none when no suffix recurs."""
        if max_tokens < 1:
            return []
        tokens = seq.token_ids
        packed = self.pack(seq)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = latest_occurrence(packed, n, len(tokens))
            if start is not None:
                return tokens[start + n:start + n + max_tokens]
        return []

    def pack(self, seq: Sequence) -> bytearray:
        packed = self.packed.setdefault(seq.seq_id, bytearray())
        known = len(packed) // TOKEN_BYTES
        if known < len(seq.token_ids):
            packed += array("I", seq.token_ids[known:]).tobytes()
        return packed

    def forget(self, seq_id: str) -> None:
        self.packed.pop(seq_id, None)


def latest_occurrence(packed: bytearray, n: int, num_tokens: int) -> int | None:
    """Where the latest occurrence of the last n tokens starts, among those that end before the last token (so at
    least one token follows it); None if there is none."""
    suffix = bytes(packed[(num_tokens - n) * TOKEN_BYTES:num_tokens * TOKEN_BYTES])
    end = (num_tokens - 1) * TOKEN_BYTES
    while (found := packed.rfind(suffix, 0, end)) >= 0:
        if found % TOKEN_BYTES == 0:
            return found // TOKEN_BYTES
        end = found + len(suffix) - 1   # a match across token boundaries: look further back
    return None
