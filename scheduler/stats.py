"""The StatsResponse a scheduler answers with: its gauges (queues, KV pool) and cumulative counters."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from protos import scheduler_pb2
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence


@dataclass
class StepCounters:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    chunked_prefills: int = 0       # prefill steps that computed only part of a prompt
    interrupted_steps: int = 0      # cut short for a request that outranked their work (Scheduler.take_back)
    spec_drafts: int = 0            # speculative proposals verified
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: list[int] = field(default_factory=list)   # [i]: proposals whose token i was kept

    def count_verified(self, num_proposed: int, num_accepted: int) -> None:
        self.spec_drafts += 1
        self.spec_proposed_tokens += num_proposed
        self.spec_accepted_tokens += num_accepted
        missing = num_proposed - len(self.spec_accepted_by_position)
        self.spec_accepted_by_position.extend([0] * max(0, missing))
        for position in range(num_accepted):
            self.spec_accepted_by_position[position] += 1


class SchedulerState(Protocol):
    """What the stats read of a scheduler (scheduler.core.Scheduler, which imports this module)."""
    block_manager: BlockManager
    block_size: int
    counters: StepCounters
    running: list[Sequence]
    waiting: deque[Sequence]


def stats_response(scheduler: SchedulerState) -> scheduler_pb2.StatsResponse:
    bm, counters, block_size = scheduler.block_manager, scheduler.counters, scheduler.block_size
    return scheduler_pb2.StatsResponse(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), num_blocks=bm.num_blocks,
        num_free_blocks=bm.num_free_blocks, num_cached_free_blocks=bm.num_cached_free_blocks,
        block_size=block_size, prefix_cache_queries=bm.counters.queries,
        prefix_cache_hits=bm.counters.hits, num_preemptions=counters.preemptions,
        num_interrupted_steps=counters.interrupted_steps,
        num_evictions=bm.counters.evictions,
        waiting_tokens=queued_prefill_tokens(scheduler),
        running_tokens=sum(s.num_tokens for s in scheduler.running),
        prompt_tokens_total=counters.prompt_tokens, generation_tokens_total=counters.generation_tokens,
        num_steps=counters.steps, spec_decode_num_drafts=counters.spec_drafts,
        spec_decode_num_draft_tokens=counters.spec_proposed_tokens,
        spec_decode_num_accepted_tokens=counters.spec_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=counters.spec_accepted_by_position,
        lora_adapters=sorted(scheduler.lora.loaded), resident_lora_adapters=scheduler.lora.resident,
        running_lora_adapters=sorted({s.lora_name for s in scheduler.running if s.lora_name}),
        waiting_lora_adapters=sorted({s.lora_name for s in scheduler.waiting if s.lora_name}),
        max_loras=scheduler.lora.max_loras if scheduler.lora.enabled else 0)


def queued_prefill_tokens(scheduler: SchedulerState) -> int:
    """The prefill the waiting queue holds: each waiting prompt less its leading blocks that are cached, or that a
    sequence ahead of it (running, or earlier in the queue) computes first. Ten queued requests of one cold system
    prompt are one prefill of it and ten suffixes, not ten prefills: what a router weighs a queue by."""
    bm, block_size = scheduler.block_manager, scheduler.block_size
    ahead: set[int] = {h for seq in scheduler.running for h in seq.block_hashes}
    total = 0
    for seq in scheduler.waiting:
        covered = 0
        for block_hash in bm.reusable_hashes(seq):
            if block_hash not in bm.cached and block_hash not in ahead:
                break
            covered += 1
        total += max(0, seq.num_tokens - seq.num_computed_tokens - covered * block_size)
        ahead.update(seq.block_hashes)
    return total
