"""Proposals under a structured output or bad words: each proposed token must be one its position's mask allows,
and every position the step samples gets its own mask. The grammar is advanced through the proposals to fill
them, then rolled back: it takes the tokens the step keeps once they are known, as after any step."""
from __future__ import annotations

import copy
from typing import Any

from scheduler.grammar_compilation import next_token_mask
from scheduler.grammar_masks import StructuredOutputManager


def checked_proposals(manager: StructuredOutputManager, seq_id: str, proposals: list[int]
                      ) -> tuple[list[int], list[Any]]:
    """The leading proposals the constraints allow (none past a stop token: the grammar would end there), and the
    masks of the positions they sample at: one more than the proposals kept. The row's mask must be ready."""
    row = manager.rows[seq_id]
    bad_words = copy.deepcopy(row.bad_words)
    masks = [manager.allowed(row, row.mask, bad_words)]   # row.mask stays until the step is built with these
    if row.slow or row.thinking():   # slow: not on the step loop's thread; thinking: where the grammar starts is
        return [], masks              # not known before the proposals are checked
    kept = []
    try:
        for token_id in proposals:
            if token_id in manager.stop_token_ids or not is_allowed(masks[-1], token_id):
                break
            if row.matcher is not None and not row.matcher.accept_token(token_id):
                break
            kept.append(token_id)
            if bad_words is not None:
                bad_words.accept(token_id)
            grammar_mask = next_token_mask(row.matcher, manager.vocab_size) if row.matcher is not None else None
            masks.append(manager.allowed(row, grammar_mask, bad_words))
    finally:
        if row.matcher is not None and kept:
            row.matcher.rollback(len(kept))
    return kept, masks


def is_allowed(mask: Any, token_id: int) -> bool:
    word = token_id >> 5
    return word < mask.size and bool((int(mask[word]) >> (token_id & 31)) & 1)
