"""What this router sent where: an LRU map of prompt block hashes to the schedulers they were routed to.

It is the router's own guess of each scheduler's prefix cache, with no Redis (SGLang's cache-aware router keeps
the same guess in a radix tree per worker). Chained block hashes name whole prefixes, so a hash map walked block
by block is a radix tree. It also remembers the prefill work it sent each scheduler recently, which the
schedulers' heartbeats have not reported yet.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RoutedWork:
    sent_at: float
    tokens: int
    request_id: str = ""


@dataclass
class RoutingHistory:
    capacity_blocks: int = 1 << 16                    # per scheduler: blocks it is guessed to hold, LRU beyond
    holders: dict[int, dict[str, float]] = field(default_factory=dict)   # block hash -> {scheduler: last sent}
    lru: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    routed: dict[str, deque[RoutedWork]] = field(default_factory=dict)
    unfinished: dict[str, RoutedWork] = field(default_factory=dict)   # by request id, while in a window

    def record(self, scheduler_id: str, block_hashes: Sequence[int], work_tokens: int, now: float,
               request_id: str = "") -> None:
        """scheduler_id was sent a prompt with these blocks, work_tokens of it not cached there."""
        lru = self.lru.setdefault(scheduler_id, OrderedDict())
        for block_hash in block_hashes:
            self.holders.setdefault(block_hash, {})[scheduler_id] = now
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        while len(lru) > self.capacity_blocks:
            self.drop(scheduler_id, lru.popitem(last=False)[0])
        work = RoutedWork(now, work_tokens, request_id)
        self.routed.setdefault(scheduler_id, deque()).append(work)
        if request_id:
            self.unfinished[request_id] = work

    def finish(self, request_id: str) -> None:
        """The request is over (done, failed or aborted): its work no longer waits at the scheduler."""
        work = self.unfinished.pop(request_id, None)
        if work is not None:
            work.tokens = 0

    def drop(self, scheduler_id: str, block_hash: int) -> None:
        holders = self.holders.get(block_hash)
        if holders is not None:
            holders.pop(scheduler_id, None)
            if not holders:
                del self.holders[block_hash]

    def matched_blocks(self, block_hashes: Sequence[int], sent_since: float = float("-inf")) -> dict[str, int]:
        """Leading prompt blocks each scheduler was sent (at or after sent_since); a chain stops at its first miss."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, block_hash in enumerate(block_hashes):
            holders = self.holders.get(block_hash, {})
            here = {s for s, sent in holders.items() if sent >= sent_since}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for scheduler_id in alive:
                matched[scheduler_id] = depth + 1
        return matched

    def recent_work(self, scheduler_id: str, now: float, window_s: float) -> int:
        """Work routed to scheduler_id in the last window_s seconds whose request has not finished. Counted from
        the decision on, not from when the stream opens: in a burst, decisions run ahead of their streams."""
        work = self.routed.get(scheduler_id)
        if not work:
            return 0
        while work and work[0].sent_at < now - window_s:
            self.unfinished.pop(work.popleft().request_id, None)
        return sum(w.tokens for w in work)
