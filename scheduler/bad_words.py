"""vLLM's `bad_words`: a sequence may not sample the token that would complete one of them. Each word is banned
as its tokens at the start of the text and after a space; the last token of a word is banned when the output
ends with the tokens before it (a one-token word always). The scheduler clears those bits of the row's bitmask."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def bad_word_token_ids(tokenizer: Any, words: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Each word as the tokenizer writes it alone and after a space, without special tokens."""
    spellings = {variant for word in words for variant in (word, " " + word.lstrip())}
    token_ids = {tuple(tokenizer.encode(text, add_special_tokens=False)) for text in spellings}
    return sorted(ids for ids in token_ids if ids)


@dataclass
class BadWords:
    """One sequence's bad words and the output tokens that may have started one."""
    token_ids: list[tuple[int, ...]]
    recent: list[int] = field(default_factory=list)   # the last output tokens, as many as the longest prefix
    keep: int = field(init=False)

    def __post_init__(self) -> None:
        self.keep = max((len(ids) - 1 for ids in self.token_ids), default=0)

    def accept(self, token_id: int) -> None:
        if self.keep:
            self.recent = (self.recent + [token_id])[-self.keep:]

    def banned_next(self) -> list[int]:
        """The tokens that would complete a bad word now."""
        banned = []
        for ids in self.token_ids:
            prefix = ids[:-1]
            if not prefix or tuple(self.recent[-len(prefix):]) == prefix:
                banned.append(ids[-1])
        return banned
