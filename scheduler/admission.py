"""Admission control: a bounded waiting queue per scheduler, so memory stays bounded under any load.

Past the bound a new request gets QueueFull (RESOURCE_EXHAUSTED on the wire) and the router tries another
scheduler. Seats still free in the running batch don't count as queue: a burst that fits starts at once.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from base.options import option

if TYPE_CHECKING:
    from scheduler.core import Scheduler


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int = option(512, "requests waiting beyond the running batch's free seats; more get "
                                           "RESOURCE_EXHAUSTED")
    max_queued_tokens: int = option(1 << 20, "prompt tokens those requests still have to prefill; more get "
                                             "RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1 or self.max_queued_tokens < 1:
            raise ValueError("the waiting queue bounds must be at least 1")

    def check(self, scheduler: Scheduler, num_prompt_tokens: int) -> None:
        """Raise QueueFull when one more request of num_prompt_tokens would overflow the queue (the requests waiting
        for their grammar to compile count as queued)."""
        queue = (scheduler.waiting, scheduler.compiling)
        num_queued = sum(map(len, queue))
        queued = num_queued + len(scheduler.running) - scheduler.config.max_num_seqs
        if queued < 0:
            return
        if queued >= self.max_queued_requests:
            raise QueueFull(f"the scheduler's queue is full ({num_queued} requests waiting); retry later")
        queued_tokens = sum(s.num_tokens - s.num_computed_tokens for s in itertools.chain(*queue))
        if queued_tokens + num_prompt_tokens > self.max_queued_tokens:
            raise QueueFull(f"the scheduler's queue is full ({queued_tokens} prompt tokens waiting); retry later")
