"""A draft model for speculative decoding: a smaller model with the target's vocabulary, in the same worker.

Its KV pool has as many blocks as the target's and is addressed by the same block tables and slots, so every step
it computes its KV for the tokens the target computes (follow: the same inputs and attention metadata), and after
the step it proposes, for each sequence that sampled, its greedy continuation of num_proposals tokens, one batched
decode a token, written into the slots the scheduler reserved past the sequence's tokens. Those slots are computed
again by the next step (over the kept tokens), so a rejected proposal's KV is never read.

Its proposals are its argmax: a one-token distribution, for which keeping the target's sample when it equals the
proposal is exact rejection sampling (gpu_worker/model_runner.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.kv_pool import KVPool
from gpu_worker.model import AttentionBatch
from gpu_worker.sampling.sampler import greedy_tokens


@dataclass
class DraftRow:
    """One sequence being proposed for: the token to feed next, its position, and the tokens proposed so far."""
    seq: object            # model_runner.SequenceState
    token_id: int
    position: int
    proposed: list[int]


DecodeBatch = Callable[[list[tuple[object, int]]], AttentionBatch]   # (sequence, position) rows -> their batch


@dataclass
class DraftModel:
    model: torch.nn.Module
    pool: KVPool
    max_model_len: int
    name: str = ""           # its directory's (KV transfer's layout names it)

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> None:
        """Compute the draft's KV for the step's tokens (the target's own inputs and metadata)."""
        self.model(input_ids, positions, self.pool.layers, batch)

    def propose(self, seqs: list, num_tokens: int, decode_batch: DecodeBatch) -> dict[str, list[int]]:
        """Each sequence's greedy continuation, up to num_tokens tokens and only into slots its table holds."""
        rows = [DraftRow(seq, seq.token_ids[-1], len(seq.token_ids) - 1, []) for seq in seqs]
        for step in range(num_tokens):
            active = [row for row in rows if len(row.proposed) == step and self.has_room(row)]
            if not active:
                break
            for row, token in zip(active, self.next_tokens(active, decode_batch)):
                row.proposed.append(token)
                row.token_id, row.position = token, row.position + 1
        return {row.seq.seq_id: row.proposed for row in rows if row.proposed}

    def has_room(self, row: DraftRow) -> bool:
        """The position is the model's and the table holds its slot (the scheduler reserves num_proposals)."""
        return row.position < self.max_model_len - 1 and row.position < len(row.seq.block_ids) * self.pool.block_size

    def next_tokens(self, rows: list[DraftRow], decode_batch: DecodeBatch) -> list[int]:
        device = self.pool.tensor.device
        batch = decode_batch([(row.seq, row.position) for row in rows])
        input_ids = torch.tensor([row.token_id for row in rows], dtype=torch.long, device=device)
        positions = torch.tensor([row.position for row in rows], dtype=torch.long, device=device)
        hidden = self.model(input_ids, positions, self.pool.layers, batch)
        return greedy_tokens(self.model.compute_logits(hidden)).tolist()
