"""After the worker crashed: which request to blame, and everyone else going on as if nothing happened.

The requests in the steps the crashed worker was running are the suspects. Every request goes on with the new
worker, resumed from the tokens it had (as a preempted sequence is recomputed), but the suspects rejoin half at a
time: the other half waits until the first has stepped past its recompute. A request that crashes every worker it
runs on (a query of death) is thus isolated in about log2(suspects) + 1 crashes (the last one with it on trial
alone) and fails alone, with INTERNAL, which routers do not retry elsewhere; a crash no request caused (a killed
process) costs each suspect a short wait.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from base.sampling_params import SamplingParams
from scheduler.sequence import DEFAULT_TENANCY, Tenancy

RESTART_BACKOFF_S = 1.0        # a restart soon after the last one waits this long, doubled each time, up to
MAX_RESTART_BACKOFF_S = 30.0
QUIET_S = 60.0                 # a crash this long after the last restart starts the backoff over


@dataclass
class Rejoining:
    """A request to hand the new worker: its prompt and the tokens it had generated (resumed after)."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generated: list[int]
    tenancy: Tenancy = DEFAULT_TENANCY
    lora_name: str = ""

    def resumed_params(self) -> SamplingParams:
        """Its prompt logprobs went out with its first token: a resumed request does not score its prompt again."""
        return dataclasses.replace(self.params, prompt_logprobs=None) if self.generated else self.params


@dataclass
class CrashTriage:
    probing: dict[str, int] = field(default_factory=dict)   # suspects back in, by the tokens they had then
    held: list[list[Rejoining]] = field(default_factory=list)   # halves of suspects waiting, the latest on top
    restarts: list[float] = field(default_factory=list)      # when the worker was restarted, the recent ones
    clock: Callable[[], float] = time.monotonic

    def split(self, live: list[Rejoining], suspects: set[str]) -> tuple[list[Rejoining], Rejoining | None]:
        """Who rejoins the new worker now, and the culprit if the crash pins one down (it then rejoins not)."""
        on_trial = bool(suspects & set(self.probing))
        if on_trial:    # a crash while suspects were on trial: one of them did it
            suspects &= set(self.probing)
        accused = [r for r in live if r.request_id in suspects]
        culprit = accused[0] if on_trial and len(accused) == 1 else None   # crashed it twice, the second time alone
        if culprit is not None:
            accused = []
        first, second = accused[:(len(accused) + 1) // 2], accused[(len(accused) + 1) // 2:]
        self.probing = {r.request_id: len(r.generated) for r in first}
        if second:
            self.held.append(second)
        admitted = [r for r in live if r.request_id not in suspects] + first
        return admitted, culprit

    def release(self, generated_count: Callable[[str], int | None]) -> list[Rejoining]:
        """The latest held half of suspects, once every probing one has a token more than it rejoined with, or
        has ended (generated_count: None); that half is then the one on trial."""
        if any((n := generated_count(rid)) is not None and n <= had for rid, had in self.probing.items()):
            return []
        released = self.held.pop() if self.held else []
        self.probing = {r.request_id: len(r.generated) for r in released}
        return released

    def drop(self, request_id: str) -> None:
        """An aborted request: no longer held or on trial."""
        self.held = [kept for half in self.held if (kept := [r for r in half if r.request_id != request_id])]
        self.probing.pop(request_id, None)

    def restart_delay(self) -> float:
        """How long to wait before starting the next worker: 0 after a quiet spell, else doubling."""
        now = self.clock()
        if self.restarts and now - self.restarts[-1] >= QUIET_S:
            self.restarts = []
        delay = 0.0 if not self.restarts else min(MAX_RESTART_BACKOFF_S,
                                                  RESTART_BACKOFF_S * 2 ** (len(self.restarts) - 1))
        self.restarts.append(now + delay)
        return delay
