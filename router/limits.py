"""Per-API-key limits, so that one client cannot starve the rest: streams in flight, and tokens a minute (a token
bucket that refills continuously). A request is admitted once its prompt is tokenized, if its key has a stream free
and budget left for the whole prompt, which is charged then; completion tokens are charged as they stream, so a
key may end in debt and then waits until the budget has refilled. A request that fails before its first token is
given its prompt back; one whose client hangs up is not. A key over either limit gets RESOURCE_EXHAUSTED / HTTP 429
with a Retry-After of when it may try again.

KeyLimiter counts within one router; router/shared_limits.py shares the counts among routers through Redis.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from base.options import option


@dataclass(frozen=True)
class KeyLimits:
    max_concurrent: int = option(0, "streams in flight per API key, counted across the routers on one Redis; "
                                    "more get RESOURCE_EXHAUSTED / HTTP 429; 0: no cap",
                                 flag="--max-concurrent-requests-per-key")
    tokens_per_minute: int = option(0, "prompt + completion tokens per API key per minute, across the routers on "
                                       "one Redis; a prompt the budget left cannot cover gets 429 until it has "
                                       "refilled; 0: no cap", flag="--max-tokens-per-minute-per-key")

    def __post_init__(self) -> None:
        if self.max_concurrent < 0 or self.tokens_per_minute < 0:
            raise ValueError("per-key limits must be 0 (no cap) or positive")


class OverLimit(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


def streams_over(limits: KeyLimits) -> OverLimit:
    return OverLimit(f"this API key is at its limit of {limits.max_concurrent} concurrent requests; retry later", 1)


def check_budget(limits: KeyLimits, budget: float, prompt_tokens: int) -> None:
    """OverLimit unless `budget` (the key's tokens left) covers the prompt; a key in debt waits until it is not."""
    per_minute = limits.tokens_per_minute
    if prompt_tokens > per_minute:
        raise OverLimit(f"this prompt of {prompt_tokens} tokens is more than this API key's {per_minute} tokens a "
                        "minute: it can never be admitted", 60)
    needed = max(1, prompt_tokens)
    if budget < needed:
        wait = math.ceil((needed - budget) / (per_minute / 60.0))
        raise OverLimit(f"this API key used its {per_minute} tokens a minute (left: {max(0, math.floor(budget))}, "
                        f"this prompt: {prompt_tokens}); retry in {wait} s", wait)


class Limiter(Protocol):
    """What a KeyLease asks of its limiter: `take` admits a stream (OverLimit if refused) and says which limiter
    counted it and its id there; `charge` tokens; `give_back` the stream at its end."""

    async def take(self, key: str, prompt_tokens: int) -> tuple[Limiter, str]: ...

    def charge(self, key: str, tokens: int) -> None: ...

    async def give_back(self, key: str, stream: str) -> None: ...


@dataclass
class KeyLease:
    """One request's hold on its API key's limits: `admit` once the prompt's length is known (OverLimit if refused),
    `charge` completion tokens as they stream, `release` at the end. Until admitted it holds nothing, so a request
    refused before then releases nothing."""
    limiter: Limiter   # once admitted: the limiter that counted it (a shared one's fallback, when Redis is down)
    key: str
    stream: str = ""   # the limiter's id for this request's stream
    prompt_tokens: int = 0
    admitted: bool = False

    async def admit(self, prompt_tokens: int) -> None:
        self.limiter, self.stream = await self.limiter.take(self.key, prompt_tokens)
        self.prompt_tokens, self.admitted = prompt_tokens, True

    def charge(self, tokens: int) -> None:
        if self.admitted and tokens:
            self.limiter.charge(self.key, tokens)

    def refund_prompt(self) -> None:
        self.charge(-self.prompt_tokens)
        self.prompt_tokens = 0

    async def release(self) -> None:
        if self.admitted:
            self.admitted = False
            await self.limiter.give_back(self.key, self.stream)


@dataclass
class KeyUsage:
    in_flight: int = 0
    budget: float = 0.0            # tokens left this minute (a token bucket); negative: in debt
    refilled_at: float = 0.0


@dataclass
class KeyLimiter:
    """The limits counted by this router alone."""
    limits: KeyLimits = KeyLimits()
    clock: Callable[[], float] = time.monotonic
    usage: dict[str, KeyUsage] = field(default_factory=dict)

    def lease(self, key: str) -> KeyLease:
        return KeyLease(self, key)

    async def take(self, key: str, prompt_tokens: int) -> tuple[KeyLimiter, str]:
        self.admit(key, prompt_tokens)
        return self, ""

    def admit(self, key: str, prompt_tokens: int = 0) -> None:
        """Count a new stream for key and charge its prompt, or raise OverLimit."""
        usage = self.refilled(key)
        if self.limits.max_concurrent and usage.in_flight >= self.limits.max_concurrent:
            raise streams_over(self.limits)
        if self.limits.tokens_per_minute:
            check_budget(self.limits, usage.budget, prompt_tokens)
            usage.budget -= prompt_tokens
        usage.in_flight += 1

    def charge(self, key: str, tokens: int) -> None:
        """Charge key's budget `tokens` (negative: a refund, up to the full budget)."""
        if self.limits.tokens_per_minute and tokens:
            usage = self.refilled(key)
            usage.budget = min(float(self.limits.tokens_per_minute), usage.budget - tokens)

    async def give_back(self, key: str, stream: str) -> None:
        self.release(key)

    def release(self, key: str) -> None:
        usage = self.refilled(key)
        usage.in_flight -= 1
        if not usage.in_flight and usage.budget >= self.limits.tokens_per_minute:
            del self.usage[key]   # idle and owing nothing: forget it

    async def close(self) -> None:
        """Nothing to give back: the counts live in this process."""

    @property
    def refill_rate(self) -> float:
        return self.limits.tokens_per_minute / 60.0

    def refilled(self, key: str) -> KeyUsage:
        now = self.clock()
        usage = self.usage.get(key)
        if usage is None:
            usage = self.usage[key] = KeyUsage(budget=float(self.limits.tokens_per_minute), refilled_at=now)
        elapsed, usage.refilled_at = now - usage.refilled_at, now
        usage.budget = min(float(self.limits.tokens_per_minute), usage.budget + elapsed * self.refill_rate)
        return usage
