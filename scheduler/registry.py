"""A scheduler's presence in Redis: its registration (heartbeat with a TTL) and its KV block events.

Key scheme (every key starts with the prefix, default "ferry"):
  <prefix>:scheduler:<scheduler_id>   string, JSON of SchedulerInfo (address, model, model_path, block_size,
                                      max_model_len, vocab_size, hash_seed and load: waiting/running requests
                                      and tokens), SET with EX=ttl on every heartbeat; a dead scheduler's key
                                      expires on its own.
  <prefix>:blk:<model>:<hash>         set of scheduler ids holding the KV block whose chained hash
                                      (protos.block_hash) is <hash> (decimal u64): SADD on store, SREM on evict.
Redis accelerates routing and is never needed for correctness: every write here may fail and is then dropped.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

log = logging.getLogger(__name__)
KEY_PREFIX = "ferry"


@dataclass
class SchedulerInfo:
    scheduler_id: str
    address: str
    model: str
    model_path: str
    block_size: int
    max_model_len: int
    vocab_size: int
    hash_seed: int = 0
    num_waiting: int = 0
    num_running: int = 0
    waiting_tokens: int = 0
    running_tokens: int = 0

    @property
    def load_tokens(self) -> int:
        return self.waiting_tokens + self.running_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> SchedulerInfo:
        fields = json.loads(text)
        return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})


def scheduler_key(scheduler_id: str, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:scheduler:{scheduler_id}"


def scheduler_key_pattern(prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:scheduler:*"


def block_key(model: str, block_hash: int, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:blk:{model}:{block_hash}"


class Registry:
    """Heartbeat and KV-event publisher of one scheduler; runs beside the loop, never inside it."""

    def __init__(self, redis_url: str, info_fn: Callable[[], SchedulerInfo], ttl: float = 3.0,
                 prefix: str = KEY_PREFIX, password: str = ""):
        self.redis = aioredis.from_url(redis_url, password=password or None, socket_timeout=1.0,
                                       socket_connect_timeout=1.0)
        self.info_fn = info_fn
        self.ttl = ttl
        self.prefix = prefix
        self.events: asyncio.Queue[tuple[list[int], list[int]]] = asyncio.Queue(maxsize=1024)
        self.held: set[int] = set()
        self.tasks: list[asyncio.Task] = []
        self.registered = asyncio.Event()   # set by the first heartbeat Redis took

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.heartbeat()), asyncio.create_task(self.publish_events())]

    def push_kv_events(self, stored: list[int], removed: list[int]) -> None:
        """Called by the loop once per iteration; never blocks (a full queue drops the batch)."""
        if stored or removed:
            try:
                self.events.put_nowait((stored, removed))
            except asyncio.QueueFull:
                pass

    async def heartbeat(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.ttl / 3)

    async def beat(self) -> bool:
        """Write this scheduler's registration once; False when Redis did not take it."""
        info = self.info_fn()
        try:
            await self.redis.set(scheduler_key(info.scheduler_id, self.prefix), info.to_json(),
                                 px=int(self.ttl * 1000))
            self.registered.set()
            return True
        except Exception as e:   # Redis down: keep serving, retry next beat
            log.warning("heartbeat to redis failed: %s", e)
            return False

    async def publish_events(self) -> None:
        while True:
            batches = [await self.events.get()]
            while not self.events.empty():
                batches.append(self.events.get_nowait())
            try:
                await self.write_events(batches)
            except Exception as e:
                log.warning("dropping %d KV event batches, redis failed: %s", len(batches), e)

    async def write_events(self, batches: list[tuple[list[int], list[int]]]) -> None:
        """One pipeline, batches in the order the loop produced them (a block may be evicted, then stored again)."""
        info = self.info_fn()
        pipe = self.redis.pipeline(transaction=False)
        for stored, removed in batches:
            for h in removed:
                pipe.srem(block_key(info.model, h, self.prefix), info.scheduler_id)
            for h in stored:
                pipe.sadd(block_key(info.model, h, self.prefix), info.scheduler_id)
        await pipe.execute()
        for stored, removed in batches:
            self.held.difference_update(removed)
            self.held.update(stored)

    async def close(self) -> None:
        """Graceful shutdown: deregister and clear this scheduler's block entries."""
        for task in self.tasks:
            task.cancel()
        info = self.info_fn()
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(scheduler_key(info.scheduler_id, self.prefix))
            for h in self.held:
                pipe.srem(block_key(info.model, h, self.prefix), info.scheduler_id)
            await pipe.execute()
        except Exception as e:
            log.warning("could not deregister from redis: %s", e)
        await self.redis.aclose()
