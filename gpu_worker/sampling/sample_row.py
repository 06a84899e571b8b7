"""One row of a step's logits as sampling sees it: the request's parameters and tokens so far, and its grammar's
token bitmask if it has one."""
from __future__ import annotations

from dataclasses import dataclass

from base.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    token_ids: list[int]        # every token so far (prompt + output)
    num_prompt_tokens: int
    sample_index: int
    bitmask: bytes | None = None   # a structured output's allowed tokens (the scheduler's grammar matcher)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
