"""The scheduler's periodic one-line log of load, KV usage and throughput, like vLLM's."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from protos import scheduler_pb2
from scheduler.block_manager import kv_usage

log = logging.getLogger("scheduler.metrics")   # the logger these lines always came from
StatsFn = Callable[[], scheduler_pb2.StatsResponse]


def kv_cache_usage(stats: scheduler_pb2.StatsResponse) -> float:
    return kv_usage(stats.num_free_blocks, stats.num_blocks)


@dataclass
class StatsLogger:
    """Every `interval` seconds while there is work: one line with load, KV usage and throughput, like vLLM's."""
    stats: StatsFn
    interval: float = 10.0
    clock: Callable[[], float] = time.monotonic
    last: scheduler_pb2.StatsResponse | None = None
    last_at: float = 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            line = self.line()
            if line:
                log.info("%s", line)

    def line(self) -> str | None:
        stats, now = self.stats(), self.clock()
        last, last_at = self.last, self.last_at
        self.last, self.last_at = stats, now
        if last is None or now <= last_at:
            return None
        prompt = stats.prompt_tokens_total - last.prompt_tokens_total
        generated = stats.generation_tokens_total - last.generation_tokens_total
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        elapsed = now - last_at
        return (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * kv_cache_usage(stats):.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
