"""Plain data: a sequence (one sample of a request) and the request that groups its n samples."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from base.sampling_params import SamplingParams
from protos import common_pb2


@dataclass(frozen=True)
class Tenancy:
    """Whose a request is and how urgent: its tenant, that tenant's weight in fair sharing, and its priority (lower
    first, as vLLM's); and the cache salt its prefix blocks hash with (they are found only by requests of the same
    salt). The router sets them; a request without them is the default tenant's, at priority 0, unsalted."""
    tenant: str = ""
    priority: int = 0
    weight: float = 1.0
    cache_salt: str = ""


DEFAULT_TENANCY = Tenancy()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int                                   # admission order: preemption takes the newest
    tenancy: Tenancy = DEFAULT_TENANCY
    arrival_step: int = 0                          # the scheduler's step count when its request arrived (aging)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of the full blocks of token_ids
    num_registered_blocks: int = 0                 # leading blocks already offered to the prefix cache
    announced_hashes: list[int] = field(default_factory=list)   # published before computed (BlockManager.announce)
    num_blocks_sent: int = 0                       # leading block ids the worker already knows
    block_table_replaced: bool = False             # a copy-on-write changed a block id the worker already knows
    num_freed_blocks: int = 0                      # leading blocks given back: wholly before the sliding window
    num_preemptions: int = 0
    kv_present_tokens: int = 0                     # a forked sample: its prompt's KV is shared, never rewritten
    proposed_token_ids: list[int] = field(default_factory=list)   # a draft model's, after its current tokens
    num_pending_tokens: int = 0                    # positions a step in flight samples or verifies, not yet known
    num_charged_tokens: int = 0                    # positions its tenant was charged for (a recompute is not)
    lora_name: str = ""                            # the LoRA adapter it runs with ("": the base model)
    hash_root: int | None = None                   # its block hash chain's root where not the model's (adapter, salt)

    @property
    def num_tokens(self) -> int:
        """Every token whose position exists: the known ones and one a step in flight is sampling."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def reads_prefix_cache(self) -> bool:
        """A cached prefix has no logits to score it with: a sequence scoring its prompt computes all of it, as in
        vLLM (recomputing just those logits would cost the same forward pass). It still offers its blocks."""
        return self.params.prompt_logprobs is None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: common_pb2.SamplingParams            # params as the request brought them: what each sample's worker gets
    tenancy: Tenancy = DEFAULT_TENANCY
    arrival_step: int = 0
    lora_name: str = ""
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    forked: bool = False                           # the n-1 siblings of sample 0 exist

    @property
    def finished(self) -> bool:
        return self.forked and all(s.status is SequenceStatus.FINISHED for s in self.seqs)
