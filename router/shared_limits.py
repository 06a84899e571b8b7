"""Per-API-key limits shared by every router on one Redis, so that N routers (`--workers N`, several pods) give a key
its limit once, not N times.

Per key, by the SHA-256 of the API key (raw keys never reach Redis): a token bucket, a hash
`ferry:limit:tokens:<sha>` of the tokens left and when they were counted, and the streams in flight, a sorted set
`ferry:limit:streams:<sha>` of stream ids scored by when their lease runs out. Admission is one script, one round
trip: prune expired streams, check the stream cap and that the budget covers the prompt, charge the prompt, add the
stream. A router renews its streams' leases while they run, so a crashed router's streams expire after
`lease_s`. Completion tokens are written in the background, batched every `sync_s`, and with the stream's
release when it ends (before its client sees the end).

When Redis does not answer, admissions are counted by this router's own KeyLimiter, as if it were alone (N routers
then let a key through N times), logged once; Redis is tried again after `retry_s`, and used again once it answers.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from protos.registration import KEY_PREFIX
from router.limits import KeyLease, KeyLimiter, KeyLimits, check_budget, streams_over

log = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
# Shared by the scripts: Redis's clock (one for every router), and the token bucket's refill and store. A bucket's
# hash expires when it would be full again: a missing one is a full one.
BUCKET_LUA = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function refilled(key, per_minute, at)
  local state = redis.call('HMGET', key, 'budget', 'at')
  if not state[1] then return per_minute end
  return math.min(per_minute, tonumber(state[1]) + math.max(0, at - tonumber(state[2])) * per_minute / 60)
end
local function store(key, budget, per_minute, at)
  redis.call('HSET', key, 'budget', string.format('%.17g', budget), 'at', string.format('%.17g', at))
  redis.call('PEXPIRE', key, string.format('%d', math.ceil((per_minute - budget) * 60000 / per_minute) + 1000))
end
"""
# KEYS: the key's bucket, its streams. ARGV: tokens a minute (0: no cap), streams at most (0: no cap), the prompt's
# tokens, the new stream's id, lease seconds. Returns {'ok'}, or why not: {'streams', count} or {'tokens', budget}.
ADMIT_LUA = BUCKET_LUA + """
local at, per_minute, max_streams, prompt = now(), tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if max_streams > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', at)
  local streams = redis.call('ZCARD', KEYS[2])
  if streams >= max_streams then return {'streams', streams} end
end
if per_minute > 0 then
  local budget = refilled(KEYS[1], per_minute, at)
  if budget < math.max(1, prompt) then return {'tokens', string.format('%.17g', budget)} end
  store(KEYS[1], budget - prompt, per_minute, at)
end
if max_streams > 0 then
  redis.call('ZADD', KEYS[2], at + tonumber(ARGV[5]), ARGV[4])
  redis.call('EXPIRE', KEYS[2], math.ceil(tonumber(ARGV[5])))
end
return {'ok'}
"""
# KEYS: a key's bucket. ARGV: tokens a minute, tokens to charge (negative: a refund, up to the full budget).
CHARGE_LUA = BUCKET_LUA + """
local at, per_minute = now(), tonumber(ARGV[1])
store(KEYS[1], math.min(per_minute, refilled(KEYS[1], per_minute, at) - tonumber(ARGV[2])), per_minute, at)
"""
# KEYS: a key's streams. ARGV: lease seconds, then the ids of this router's streams of it that still run.
RENEW_LUA = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], expiry, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])))
"""


def hashed(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def bucket_key(api_key: str) -> str:
    return f"{KEY_PREFIX}:limit:tokens:{hashed(api_key)}"


def streams_key(api_key: str) -> str:
    return f"{KEY_PREFIX}:limit:streams:{hashed(api_key)}"


@dataclass
class PendingWrites:
    """What this router owes Redis: tokens to charge per bucket, ended streams to remove per key."""
    charges: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ended: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    def __bool__(self) -> bool:
        return bool(self.charges or self.ended)

    def merge(self, other: PendingWrites) -> None:
        for bucket, tokens in other.charges.items():
            self.charges[bucket] += tokens
        for key, ids in other.ended.items():
            self.ended[key] |= ids


@dataclass
class SharedKeyLimiter:
    limits: KeyLimits
    redis_url: str
    redis_password: str = ""
    lease_s: float = 30.0      # a stream not renewed this long (its router died) no longer counts
    retry_s: float = 5.0       # after Redis failed, how long admissions go to the fallback before Redis is tried
    sync_s: float = 0.25       # how often completion tokens are written
    clock: Callable[[], float] = time.monotonic
    fallback: KeyLimiter = field(init=False)
    redis_down_until: float | None = None   # None: Redis answered last time

    def __post_init__(self) -> None:
        self.fallback = KeyLimiter(self.limits)
        self.redis = aioredis.from_url(self.redis_url, password=self.redis_password or None, socket_timeout=1.0,
                                       socket_connect_timeout=1.0)
        self.admit_script = self.redis.register_script(ADMIT_LUA)
        self.charge_script = self.redis.register_script(CHARGE_LUA)
        self.renew_script = self.redis.register_script(RENEW_LUA)
        self.stream_ids = (f"{uuid.uuid4().hex[:12]}:{n}" for n in itertools.count())
        self.running: dict[str, set[str]] = defaultdict(set)   # streams key -> this router's streams in Redis
        self.pending = PendingWrites()
        self.renew_due = 0.0
        self.syncing: asyncio.Task | None = None

    def lease(self, key: str) -> KeyLease:
        return KeyLease(self, key)

    async def take(self, key: str, prompt_tokens: int) -> tuple[SharedKeyLimiter | KeyLimiter, str]:
        """Admit a stream for key and charge its prompt (OverLimit if refused): in Redis, or, when it does not
        answer, in the fallback. Returns the limiter that counted it and the stream's id there."""
        self.start_syncing()
        if self.redis_down():
            return await self.fallback.take(key, prompt_tokens)
        stream = next(self.stream_ids)
        try:
            verdict = await self.admit_script(keys=[bucket_key(key), streams_key(key)],
                                              args=[self.limits.tokens_per_minute, self.limits.max_concurrent,
                                                    prompt_tokens, stream, self.lease_s])
        except REDIS_ERRORS as e:
            self.redis_failed(e)
            return await self.fallback.take(key, prompt_tokens)
        self.redis_answered()
        check_verdict(self.limits, verdict, prompt_tokens)
        self.running[streams_key(key)].add(stream)
        return self, stream

    def charge(self, key: str, tokens: int) -> None:
        if self.limits.tokens_per_minute and tokens:
            self.pending.charges[bucket_key(key)] += tokens

    async def give_back(self, key: str, stream: str) -> None:
        """End a stream: its removal and the key's pending tokens written now, before its client sees the end."""
        streams, bucket, writes = streams_key(key), bucket_key(key), PendingWrites()
        self.running[streams].discard(stream)
        if not self.running[streams]:
            del self.running[streams]
        writes.ended[streams].add(stream)
        if bucket in self.pending.charges:
            writes.charges[bucket] = self.pending.charges.pop(bucket)
        if self.redis_down():
            self.pending.merge(writes)
        else:
            await self.flush(writes)

    def start_syncing(self) -> None:
        if self.syncing is None:
            self.syncing = asyncio.create_task(self.keep_in_sync())

    async def keep_in_sync(self) -> None:
        while True:
            await asyncio.sleep(self.sync_s)
            await self.sync()

    async def sync(self) -> None:
        """Write the tokens charged since the last sync (and what failed to be written), and renew the leases of
        this router's streams when they are due."""
        renew = self.clock() >= self.renew_due and bool(self.running)
        if (self.pending or renew) and not self.redis_down() and await self.flush(self.take_pending(), renew) and renew:
            self.renew_due = self.clock() + self.lease_s / 3

    def take_pending(self) -> PendingWrites:
        writes, self.pending = self.pending, PendingWrites()
        return writes

    async def flush(self, writes: PendingWrites, renew: bool = False) -> bool:
        """Write `writes` (and renew the leases); whether Redis took them. What it did not is kept for the next
        sync; a lease left unrenewed just expires."""
        try:
            await self.write(writes, renew)
        except REDIS_ERRORS as e:
            self.pending.merge(writes)
            self.redis_failed(e)
            return False
        except asyncio.CancelledError:   # its request was cancelled while writing: the next sync writes it
            self.pending.merge(writes)
            raise
        self.redis_answered()
        return True

    async def write(self, writes: PendingWrites, renew: bool) -> None:
        renewals = {streams: sorted(ids) for streams, ids in self.running.items()} if renew else {}
        pipe = self.redis.pipeline(transaction=False)
        for bucket, tokens in writes.charges.items():
            await self.charge_script(keys=[bucket], args=[self.limits.tokens_per_minute, tokens], client=pipe)
        for streams, ids in writes.ended.items():
            pipe.zrem(streams, *ids)
        for streams, ids in renewals.items():
            await self.renew_script(keys=[streams], args=[self.lease_s, *ids], client=pipe)
        await pipe.execute()

    def redis_down(self) -> bool:
        """Whether Redis failed less than `retry_s` ago (then it is not tried)."""
        return self.redis_down_until is not None and self.clock() < self.redis_down_until

    def redis_failed(self, error: Exception) -> None:
        if self.redis_down_until is None:
            log.warning("redis unreachable: per-key limits are counted by this router alone until it answers: %s",
                        error)
        self.redis_down_until = self.clock() + self.retry_s

    def redis_answered(self) -> None:
        if self.redis_down_until is not None:
            log.warning("redis answers again: per-key limits are shared by the routers again")
        self.redis_down_until = None

    async def close(self) -> None:
        """Stop syncing, write what is pending, close the connection."""
        if self.syncing is not None:
            self.syncing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.syncing
        if self.pending:
            await self.flush(self.take_pending())
        await self.redis.aclose()


def check_verdict(limits: KeyLimits, verdict: list, prompt_tokens: int) -> None:
    """OverLimit for the admission script's refusal."""
    reason = verdict[0].decode()
    if reason == "streams":
        raise streams_over(limits)
    if reason == "tokens":   # Redis found the budget short of the prompt: check_budget says so, with the wait
        check_budget(limits, float(verdict[1]), prompt_tokens)


def key_limiter(limits: KeyLimits, redis_url: str, redis_password: str = "") -> KeyLimiter | SharedKeyLimiter:
    """Limits shared through Redis when the router has one and there are limits to count; else its own."""
    if redis_url and (limits.max_concurrent or limits.tokens_per_minute):
        return SharedKeyLimiter(limits, redis_url, redis_password)
    return KeyLimiter(limits)
