"""Bounded retries of requests a scheduler failed (UNAVAILABLE) before any of their tokens reached the client.

Three limits keep a poisoned request or a dying cluster from multiplying load: attempts per request, a global
token bucket of retries (a rate and a burst), and a circuit breaker per scheduler. A breaker counts failure
incidents — requests failing together (a crashed worker fails all it holds at once) count once — and after
`breaker_failures` in a row it opens: the scheduler is skipped for `breaker_cooldown` seconds, then half-open,
where the next success closes it and the next failure opens it again. When every candidate's breaker is open the
router still tries them (failing open), so a lone scheduler is never shut off by its own breaker.
"""
from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from base.options import option
from protos.registration import SchedulerInfo

Clock = Callable[[], float]


@dataclass(frozen=True)
class RetryOptions:
    max_attempts: int = option(3, "tries a request gets in all: once this many schedulers failed it (UNAVAILABLE), "
                                  "its error is final", flag="--retry-max-attempts")
    budget_rate: float = option(100.0, "retries per second the router's global retry budget refills",
                                flag="--retry-budget-rate")
    # all that one dead scheduler held (256 running + 512 queued by default) can be retried at once
    budget_burst: float = option(1024.0, "retries the global retry budget holds at most", flag="--retry-budget-burst")
    breaker_failures: int = option(3, "failure incidents in a row after which a scheduler is skipped (circuit "
                                      "breaker)")
    breaker_cooldown: float = option(10.0, "seconds a scheduler whose breaker opened is skipped before it is tried "
                                           "again")

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.breaker_failures < 1:
            raise ValueError("retry max attempts and breaker failures must be at least 1")
        if min(self.budget_rate, self.budget_burst, self.breaker_cooldown) < 0:
            raise ValueError("retry budget and breaker cool-down must not be negative")


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass
class RetryBudget:
    """A token bucket: each retry takes one token; tokens come back at `rate` per second up to `burst`."""
    rate: float
    burst: float
    clock: Clock = time.monotonic
    tokens: float = field(init=False)
    updated_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens, self.updated_at = self.burst, self.clock()

    def try_spend(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated_at) * self.rate)
        self.updated_at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class CircuitBreaker:
    failure_threshold: int
    cooldown: float
    clock: Clock = time.monotonic
    consecutive_failures: int = 0
    opened_at: float | None = None
    last_failure_at: float = -math.inf

    def state(self) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self.opened_at < self.cooldown:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allows(self) -> bool:
        return self.state() != BreakerState.OPEN

    def on_success(self) -> None:
        self.consecutive_failures, self.opened_at = 0, None

    def on_failure(self, attempt_started_at: float) -> bool:
        """Count a failed attempt; True when this failure opened the breaker. An attempt that began before the
        last counted failure belongs to that same incident and is not counted again."""
        if attempt_started_at < self.last_failure_at:
            return False
        now, state = self.clock(), self.state()
        self.last_failure_at = now
        self.consecutive_failures += 1
        if state == BreakerState.HALF_OPEN or (state == BreakerState.CLOSED
                                               and self.consecutive_failures >= self.failure_threshold):
            self.opened_at = now
            return True
        return False


@dataclass(frozen=True)
class RetryDenied:
    label: str                       # for metrics: attempts, budget
    reason: str                      # for the client


@dataclass(frozen=True)
class RoutePlan:
    targets: list[SchedulerInfo]     # in the order to try them
    skipped: list[str]               # scheduler ids whose breaker is open


@dataclass
class RetryGovernor:
    """Owns the limits: which schedulers a request may go to, and whether a failed one may be retried."""
    options: RetryOptions = field(default_factory=RetryOptions)
    clock: Clock = time.monotonic
    breakers: dict[str, CircuitBreaker] = field(default_factory=dict)
    budget: RetryBudget = field(init=False)

    def __post_init__(self) -> None:
        self.budget = RetryBudget(self.options.budget_rate, self.options.budget_burst, self.clock)

    def breaker(self, scheduler_id: str) -> CircuitBreaker:
        if scheduler_id not in self.breakers:
            self.breakers[scheduler_id] = CircuitBreaker(self.options.breaker_failures, self.options.breaker_cooldown,
                                                         self.clock)
        return self.breakers[scheduler_id]

    def plan(self, ranked: Sequence[SchedulerInfo]) -> RoutePlan:
        allowed = [info for info in ranked if self.breaker(info.scheduler_id).allows()]
        if not allowed:   # every breaker open: fail open rather than refuse everything
            return RoutePlan(list(ranked), [])
        skipped = [info.scheduler_id for info in ranked if info not in allowed]
        return RoutePlan(allowed, skipped)

    def retry_denied(self, failed_attempts: int) -> RetryDenied | None:
        """Why a request that failed `failed_attempts` times may not be sent again, or None if it may (and then
        the retry has taken its token from the budget)."""
        if failed_attempts >= self.options.max_attempts:
            return RetryDenied("attempts", f"{failed_attempts} attempts, the most per request")
        if not self.budget.try_spend():
            return RetryDenied("budget", "the router's retry budget is spent")
        return None

    def on_success(self, scheduler_id: str) -> None:
        self.breaker(scheduler_id).on_success()

    def on_failure(self, scheduler_id: str, attempt_started_at: float) -> bool:
        return self.breaker(scheduler_id).on_failure(attempt_started_at)

    def states(self) -> dict[str, BreakerState]:
        return {scheduler_id: breaker.state() for scheduler_id, breaker in self.breakers.items()}
