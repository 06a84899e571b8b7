"""Why a sample stops after a token: a stop token, end of sequence, a completed grammar, or its length limit."""
from __future__ import annotations

from scheduler.sequence import Sequence


def finish_reason(seq: Sequence, token_id: int, eos_token_ids: frozenset[int], max_model_len: int,
                  grammar_terminated: bool) -> tuple[str | None, int | None]:
    """("stop" | "length" | None, the stop token id when one of params.stop_token_ids ended it)."""
    params = seq.params
    if token_id in params.stop_token_ids:
        return "stop", token_id
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop", None
    if grammar_terminated:   # the grammar is complete and took a stop token
        return "stop", None
    if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length", None
    return None, None
