"""Per-API-key limits, so that one client cannot starve the rest: streams in flight, and tokens a minute (prompt and
completion tokens, charged as they are counted; a key past its budget waits until the budget has refilled).
A key over either limit gets RESOURCE_EXHAUSTED / HTTP 429 with a Retry-After of when it may try again.
"""
from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KeyLimits:
    max_concurrent: int = 0        # streams in flight per key; 0: no cap
    tokens_per_minute: int = 0     # prompt + completion tokens per key per minute; 0: no cap


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-concurrent-requests-per-key", type=int, default=0,
                        help="streams in flight per API key; more get RESOURCE_EXHAUSTED / HTTP 429; 0: no cap")
    parser.add_argument("--max-tokens-per-minute-per-key", type=int, default=0,
                        help="prompt + completion tokens per API key per minute; past it, 429 until the budget "
                             "refills; 0: no cap")


def key_limits(args: argparse.Namespace) -> KeyLimits:
    if args.max_concurrent_requests_per_key < 0 or args.max_tokens_per_minute_per_key < 0:
        raise ValueError("per-key limits must be 0 (no cap) or positive")
    return KeyLimits(args.max_concurrent_requests_per_key, args.max_tokens_per_minute_per_key)


class OverLimit(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


@dataclass
class KeyUsage:
    in_flight: int = 0
    budget: float = 0.0            # tokens left this minute (a token bucket); negative: in debt
    refilled_at: float = 0.0


@dataclass
class KeyLimiter:
    limits: KeyLimits = KeyLimits()
    clock: Callable[[], float] = time.monotonic
    usage: dict[str, KeyUsage] = field(default_factory=dict)

    def admit(self, key: str) -> None:
        """Count a new stream for key, or raise OverLimit."""
        usage = self.refilled(key)
        if self.limits.max_concurrent and usage.in_flight >= self.limits.max_concurrent:
            raise OverLimit(f"this API key is at its limit of {self.limits.max_concurrent} concurrent requests; "
                            "retry later", 1)
        if self.limits.tokens_per_minute and usage.budget <= 0:
            wait = math.ceil((1 - usage.budget) / self.refill_rate)
            raise OverLimit(f"this API key used its {self.limits.tokens_per_minute} tokens a minute; "
                            f"retry in {wait} s", wait)
        usage.in_flight += 1

    def charge(self, key: str, tokens: int) -> None:
        if self.limits.tokens_per_minute and tokens:
            self.refilled(key).budget -= tokens

    def release(self, key: str) -> None:
        usage = self.usage[key]
        usage.in_flight -= 1
        if not usage.in_flight and usage.budget >= self.limits.tokens_per_minute:
            del self.usage[key]   # idle and owing nothing: forget it

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
