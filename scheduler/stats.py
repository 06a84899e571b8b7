"""The StatsResponse a scheduler answers with: its gauges (queues, KV pool) and cumulative counters."""
from __future__ import annotations

from typing import TYPE_CHECKING

from protos import scheduler_pb2

if TYPE_CHECKING:
    from scheduler.core import Scheduler


def stats_response(scheduler: Scheduler) -> scheduler_pb2.StatsResponse:
    bm, counters, block_size = scheduler.block_manager, scheduler.counters, scheduler.block_size
    return scheduler_pb2.StatsResponse(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), num_blocks=bm.num_blocks,
        num_free_blocks=bm.num_free_blocks, num_cached_free_blocks=bm.num_cached_free_blocks,
        block_size=block_size, prefix_cache_queries=bm.counters.queries,
        prefix_cache_hits=bm.counters.hits, num_preemptions=counters.preemptions,
        num_evictions=bm.counters.evictions,
        waiting_tokens=sum(s.num_tokens - s.num_computed_tokens - len(bm.match_prefix(s)) * block_size
                           for s in scheduler.waiting),   # net of the prefix cache: the prefill the queue holds
        running_tokens=sum(s.num_tokens for s in scheduler.running),
        prompt_tokens_total=counters.prompt_tokens, generation_tokens_total=counters.generation_tokens,
        num_steps=counters.steps)
