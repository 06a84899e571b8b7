"""What one step gives one request's sample: its new tokens, and how it ended once it did."""
from __future__ import annotations

from dataclasses import dataclass, field

from protos import common_pb2


@dataclass
class RequestOutput:
    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None        # None | "length" | "stop" | "abort"
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None   # with sample 0's first token, when asked
    embedding: list[float] | None = None    # with a sample's first token, when asked
    error: str | None = None                # the request failed (finish_reason "abort"): why
    overloaded: bool = False                # the error is the scheduler's load, not the request's: retry later
