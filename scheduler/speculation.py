"""Which decodes get proposals, and how many: the speculative-decoding policy the scheduler asks each step.

Proposals are scheduled tokens like any other: a decode with k of them takes 1 + k of the step's budget and KV
slots for them. They stop at the request's max_tokens and the model's length. The whole batch stops proposing at
batch sizes where verifying them costs more than the steps they save, as measured (scheduler/speculation_payoff.py),
or, where disable_by_batch_size is set, at that many sequences."""
from __future__ import annotations

from base.speculative import SpeculativeConfig, parse_speculative_config
from scheduler.ngram_proposer import NgramProposer
from scheduler.sequence import Sequence
from scheduler.speculation_payoff import SpeculationPayoff


class Speculation:
    def __init__(self, config_text: str, max_model_len: int):
        self.config: SpeculativeConfig | None = parse_speculative_config(config_text)
        self.in_worker = self.config is not None and self.config.method == "draft_model"
        self.proposer = NgramProposer(self.config) if self.config and not self.in_worker else None
        self.max_model_len = max_model_len
        self.payoff = SpeculationPayoff()

    @property
    def lookahead(self) -> int:
        """KV slots a sampling sequence needs past this step's tokens: where a draft model writes its proposals."""
        return self.config.num_speculative_tokens if self.in_worker else 0

    def active(self, num_running: int) -> bool:
        """Whether decodes get proposals at this batch size."""
        if self.config is None:
            return False
        limit = self.config.disable_by_batch_size
        return self.payoff.pays_at(num_running) if limit is None else num_running < limit

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Proposals for seq's next tokens, within the step's budget left (its last token's included)."""
        limit = min(self.config.num_speculative_tokens, budget - 1,
                    seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        if self.in_worker:
            proposed, seq.proposed_token_ids = seq.proposed_token_ids, []
            return proposed[:max(0, limit)]
        return self.proposer.propose(seq, limit)

    def forget(self, seq_id: str) -> None:
        if self.proposer is not None:
            self.proposer.forget(seq_id)
