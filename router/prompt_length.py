"""A prompt's length before it is tokenized, and where it is tokenized: a character count refuses, untokenized, a
prompt that cannot fit the model's context; a long prompt is rendered and tokenized in a thread, so that the
router's event loop keeps serving the other requests meanwhile."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
MAX_CHARS_PER_TOKEN = 64     # far above any tokenizer's average (3 to 5; 16 for a run of spaces)
LONG_PROMPT_CHARS = 16_384   # longer prompts are rendered and tokenized off the event loop


def check_prompt_chars(field: str, num_chars: int, max_model_len: int) -> None:
    """ValueError naming the field if num_chars characters cannot fit max_model_len tokens (0: not told)."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if max_model_len and num_chars > limit:
        raise ValueError(f"{field} is {num_chars} characters, more than the model's context of {max_model_len} "
                         f"tokens can hold (at most {limit} characters)")


async def off_the_loop_if_long(num_chars: int, work: Callable[..., T], *args) -> T:
    """work(*args), which renders or tokenizes a prompt of num_chars characters: in a thread if the prompt is
    long, on the event loop if it is short (a thread's hop would cost more than the work)."""
    if num_chars <= LONG_PROMPT_CHARS:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def truncated_prompt(prompt_ids: list[int], truncate_prompt_tokens: int | None, max_tokens: int,
                     max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (-1: what the context leaves beside max_tokens; None: all)."""
    keep = truncate_prompt_tokens
    if keep == -1 and max_model_len:
        keep = max(1, max_model_len - max_tokens)
    return prompt_ids[-keep:] if keep is not None and keep > 0 else prompt_ids
