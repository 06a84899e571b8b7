"""One request of a benchmark workload: its prompt's token ids and how many tokens it generates (greedy, EOS
ignored)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
