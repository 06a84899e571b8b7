"""What a new request must satisfy before a scheduler queues it: each failure a ValueError the client reads."""
from __future__ import annotations

from collections.abc import Container

from base.prompt_checks import check_fits_context, check_token_ids
from base.sampling_params import SamplingParams
from scheduler.block_manager import BlockManager


def check_resumed(resumed_token_ids: list[int], params: SamplingParams) -> None:
    if not resumed_token_ids:
        return
    if params.n != 1:
        raise ValueError("resumed_token_ids needs n = 1: each of n samples would need its own")
    if len(resumed_token_ids) >= params.max_tokens:
        raise ValueError(f"resumed_token_ids ({len(resumed_token_ids)}) leave nothing of max_tokens "
                         f"({params.max_tokens}) to generate")


def check_new_request(request_id: str, prompt: list[int], params: SamplingParams, ids_in_use: Container[str],
                      max_model_len: int, vocab_size: int, max_num_seqs: int, max_step_tokens: int,
                      block_manager: BlockManager) -> None:
    """The id against those in use; the prompt and its parameters against the model's context and vocabulary, the
    batch and the KV pool."""
    if request_id in ids_in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if not prompt:
        raise ValueError("prompt must not be empty")
    check_fits_context(len(prompt), params.max_tokens, max_model_len)
    if vocab_size:
        check_token_ids(params.logit_bias, vocab_size, "logit_bias")
        check_token_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
    if params.n > max_num_seqs:
        raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({max_num_seqs})")
    needed = block_manager.most_blocks_held(len(prompt) + params.max_tokens, max_step_tokens)
    if needed > block_manager.num_blocks:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs {needed} KV "
                         f"blocks but the pool has only {block_manager.num_blocks}: it can never fit")
