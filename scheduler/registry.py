"""A scheduler's presence in Redis: its registration (heartbeat with a TTL) and its KV block events.

The keys and the SchedulerInfo they hold are the contract's (protos/registry.py, where the key scheme is
documented); this is the publishing side. Every write here may fail and is then dropped: Redis accelerates
routing and is never needed for correctness.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from protos.registry import KEY_PREFIX, SchedulerInfo, block_key, scheduler_key

log = logging.getLogger(__name__)


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
