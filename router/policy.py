"""Routing policies: pick one live scheduler for a request. A policy is a plain function, so new ones plug in."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from scheduler.registry import SchedulerInfo


@dataclass
class RoutingInput:
    prompt_token_ids: list[int]
    block_hashes: list[int]          # chained hashes of the prompt's full blocks (protos.block_hash)
    pending: dict[str, int]          # requests this router has in flight per scheduler id


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


POLICIES: dict[str, RoutingPolicy] = {"least_loaded": least_loaded}
