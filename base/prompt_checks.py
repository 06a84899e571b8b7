"""What a prompt must satisfy on a model, checked where a request arrives (the router before routing, the scheduler
and the in-process engine on admission): its token ids inside the vocabulary, prompt + max_tokens inside the
context. Both raise ValueError with the reason a client reads; each caller turns it into its own status."""
from __future__ import annotations

from collections.abc import Iterable


def check_token_ids(token_ids: Iterable[int], vocab_size: int, field: str = "prompt") -> None:
    """The token ids a field holds (the prompt, or a sampling field of ids) inside the vocabulary."""
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"{field} token ids must lie in [0, {vocab_size})")


def check_fits_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"max_model_len ({max_model_len})")
