"""Routing policies: pick one live scheduler for a request. A policy is a plain function, so new ones plug in."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import itertools

import xxhash

from scheduler.registry import SchedulerInfo


@dataclass
class RoutingInput:
    prompt_token_ids: list[int]
    block_hashes: list[int]          # chained hashes of the prompt's full blocks (protos.block_hash)
    pending: dict[str, int]          # requests this router has in flight per scheduler id
    matched_blocks: dict[str, int] = field(default_factory=dict)  # leading prompt blocks each scheduler holds


RoutingPolicy = Callable[[Sequence[SchedulerInfo], RoutingInput], list[SchedulerInfo]]
"""Returns the candidates in order of preference (the router tries the next one if the first is unreachable)."""


def rendezvous_weight(scheduler_id: str, key: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{scheduler_id}:{key}".encode())


def affinity_key(request: RoutingInput) -> int:
    if request.block_hashes:
        return request.block_hashes[0]
    return xxhash.xxh3_64_intdigest(str(request.prompt_token_ids[:16]).encode())


def least_loaded(candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
    """Fewest queued + running requests (registered load plus this router's own in-flight ones); ties go to
    the rendezvous-hash winner of the first prompt block, so equal prefixes land together."""
    key = affinity_key(request)

    def rank(info: SchedulerInfo) -> tuple[int, int]:
        load = max(info.num_waiting + info.num_running, request.pending.get(info.scheduler_id, 0))
        return load, -rendezvous_weight(info.scheduler_id, key)

    return sorted(candidates, key=rank)


LOAD_PENALTY_PER_TOKEN = 0.1   # a cached prompt token is worth ten tokens of queued or running work
IMBALANCE_ABSOLUTE_TOKENS = 8192
IMBALANCE_RELATIVE = 1.5


def load_tokens(info: SchedulerInfo, request: RoutingInput) -> int:
    """Queued + running tokens, with this router's own in-flight requests for what the heartbeat hasn't seen."""
    return info.load_tokens + request.pending.get(info.scheduler_id, 0) * len(request.prompt_token_ids)


def cache_aware(candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
    """Most prompt tokens already cached minus a load penalty; without any hit the rendezvous winner of the
    first block, so equal prefixes gather in one place. An imbalance guard hands the request to the least loaded
    scheduler when affinity would pile work on one."""
    key = affinity_key(request)
    block_size = candidates[0].block_size or 16

    def score(info: SchedulerInfo) -> tuple[float, int]:
        saved = request.matched_blocks.get(info.scheduler_id, 0) * block_size
        return saved - LOAD_PENALTY_PER_TOKEN * load_tokens(info, request), rendezvous_weight(info.scheduler_id, key)

    if any(request.matched_blocks.values()):
        ranked = sorted(candidates, key=score, reverse=True)
    else:
        ranked = sorted(candidates, key=lambda info: rendezvous_weight(info.scheduler_id, key), reverse=True)
    lightest = min(candidates, key=lambda info: load_tokens(info, request))
    if overloaded(load_tokens(ranked[0], request), load_tokens(lightest, request)):
        ranked.remove(lightest)
        ranked.insert(0, lightest)
    return ranked


def overloaded(load: int, lightest_load: int) -> bool:
    return (load - lightest_load > IMBALANCE_ABSOLUTE_TOKENS
            and load > IMBALANCE_RELATIVE * lightest_load)


def round_robin_policy() -> RoutingPolicy:
    turns = itertools.count()

    def round_robin(candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
        ordered = sorted(candidates, key=lambda info: info.scheduler_id)
        start = next(turns) % len(ordered)
        return ordered[start:] + ordered[:start]

    return round_robin


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "cache_aware": lambda: cache_aware,
    "least_loaded": lambda: least_loaded,
    "round_robin": round_robin_policy,
}
"""Factories: each router gets its own policy instance (round robin keeps a turn counter)."""
