"""What a request changes in its row of logits before sampling: logit_bias, allowed_token_ids, min_tokens (stop
tokens masked until reached) and a structured output's token bitmask (from the scheduler's grammar matcher). Rows
that ask for none of them cost nothing."""
from __future__ import annotations

import torch

from base.sampling_params import SamplingParams
from gpu_worker.sampling.sample_row import SampleRow
from kernels.staging import tensor_on, to_device

BITS = torch.arange(32, dtype=torch.int32)


def adjusts_logits(row: SampleRow) -> bool:
    params = row.params
    return (row.bitmask is not None or bool(params.logit_bias) or bool(params.allowed_token_ids)
            or row.num_output_tokens < params.min_tokens)


def apply_adjustments(logits: torch.Tensor, rows: list[SampleRow], eos_token_ids: tuple[int, ...]) -> None:
    """logits: float32 [R, V], one row per SampleRow. Bias first, then the grammar's masks in one pass, then
    min_tokens' (unless it would leave no token: a complete grammar allows only a stop token, and wins)."""
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            apply_logit_bias(logits[i], row.params.logit_bias)
        if row.params.allowed_token_ids:
            keep_only(logits[i], row.params.allowed_token_ids)
    masked = [i for i, row in enumerate(rows) if row.bitmask is not None]
    if masked:
        allowed = to_device(unpack_bitmasks([rows[i].bitmask for i in masked], logits.shape[1]), logits.device)
        index = tensor_on(masked, torch.long, logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens:
            mask_stop_tokens(logits[i], stop_token_ids(row.params, eos_token_ids))


def unpack_bitmasks(bitmasks: list[bytes], vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 words (bit j of word i: token 32 i + j allowed) → bool [rows, vocab_size], True: allowed."""
    words = torch.frombuffer(bytearray(b"".join(bitmasks)), dtype=torch.int32).view(len(bitmasks), -1)
    return ((words.unsqueeze(2) >> BITS) & 1).bool().flatten(1)[:, :vocab_size]


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float]) -> None:
    """logits: one float32 row. Ids past the vocabulary are ignored (the scheduler refuses them)."""
    ids = [t for t in logit_bias if t < logits.shape[0]]
    if ids:
        logits[tensor_on(ids, torch.long, logits.device)] += tensor_on([logit_bias[t] for t in ids], logits.dtype,
                                                                        logits.device)


def keep_only(logits: torch.Tensor, token_ids: tuple[int, ...]) -> None:
    """Every token but these at -inf (one float32 row; ids past the vocabulary: the scheduler refuses them)."""
    allowed = tensor_on([t for t in token_ids if t < logits.shape[0]], torch.long, logits.device)
    kept = logits.index_select(0, allowed)
    logits.fill_(float("-inf")).index_copy_(0, allowed, kept)


def stop_token_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> list[int]:
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


def mask_stop_tokens(logits: torch.Tensor, token_ids: list[int]) -> None:
    """Decided on the device (no token left: nothing masked), not read back to the host."""
    ids = tensor_on([t for t in token_ids if t < logits.shape[0]], torch.long, logits.device)
    masked = logits.index_fill(0, ids, float("-inf"))
    logits.copy_(torch.where(torch.isfinite(masked).any(), masked, logits))
