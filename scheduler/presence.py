"""A scheduler's presence in Redis: its registration (heartbeat with a TTL) and the set of blocks it holds.

The keys and the SchedulerInfo they hold are the contract's (protos/registration.py, where the key scheme is
documented); this is the publishing side. Every write here may fail and is then dropped, the block set to be
rewritten whole by the next heartbeat Redis takes: Redis accelerates routing and is never needed for correctness.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from protos import scheduler_pb2
from protos.registration import KEY_PREFIX, SchedulerInfo, blocks_key, registry_key, scheduler_key, signed_registration

log = logging.getLogger(__name__)

EVENTS_FLUSH_INTERVAL_S = 0.02   # KV events gathered this long go to Redis in one write (several steps' on a GPU)


def current_registration(identity: SchedulerInfo, stats: scheduler_pb2.StatsResponse) -> SchedulerInfo:
    """What a heartbeat publishes: the scheduler's identity with its load and LoRA adapters as its stats say now."""
    return dataclasses.replace(identity, num_waiting=stats.num_waiting, num_running=stats.num_running,
                               waiting_tokens=stats.waiting_tokens, running_tokens=stats.running_tokens,
                               lora_adapters=list(stats.lora_adapters),
                               resident_lora_adapters=list(stats.resident_lora_adapters))


class Registry:
    """Heartbeat and KV-event publisher of one scheduler; runs beside the loop, never inside it.
    held_fn: the block hashes this scheduler holds now (cached and announced), for rewriting its block set;
    cluster_token: what registrations are signed with, so that routers holding it trust them (empty: unsigned);
    flush_interval: how long KV events are gathered before one write carries them."""

    def __init__(self, redis_url: str, info_fn: Callable[[], SchedulerInfo], ttl: float = 3.0,
                 prefix: str = KEY_PREFIX, password: str = "", held_fn: Callable[[], Iterable[int]] = tuple,
                 serving_fn: Callable[[], bool] = lambda: True, cluster_token: str = "",
                 flush_interval: float = EVENTS_FLUSH_INTERVAL_S):
        self.redis = aioredis.from_url(redis_url, password=password or None, socket_timeout=1.0,
                                       socket_connect_timeout=1.0)
        self.info_fn = info_fn
        self.held_fn = held_fn
        self.serving_fn = serving_fn   # False: out of the registry (a stalled loop) until it says True again
        self.cluster_token = cluster_token
        self.ttl = ttl
        self.prefix = prefix
        self.flush_interval = flush_interval
        self.events: asyncio.Queue[tuple[list[int], list[int]]] = asyncio.Queue(maxsize=1024)
        self.tasks: list[asyncio.Task] = []
        self.registered = asyncio.Event()   # set by the first heartbeat Redis took
        # True until a rewrite of the whole block set succeeds: at start (a previous life under this id may have
        # left entries) and after any event batch was dropped.
        self.index_stale = True
        self.writing = asyncio.Lock()       # rewrites and event batches reach Redis one at a time, in order

    @functools.cached_property
    def scheduler_id(self) -> str:
        return self.info_fn().scheduler_id    # info_fn reads the load too: not once per event write

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl * 1000)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.heartbeat()), asyncio.create_task(self.publish_events())]

    def push_kv_events(self, stored: list[int], removed: list[int]) -> None:
        """Called by the loop once per iteration; never blocks (a full queue drops the batch)."""
        if stored or removed:
            try:
                self.events.put_nowait((stored, removed))
            except asyncio.QueueFull:
                self.index_stale = True

    async def heartbeat(self) -> None:
        while True:
            await (self.beat() if self.serving_fn() else self.leave())
            await asyncio.sleep(self.ttl / 3)

    async def beat(self) -> bool:
        """Write this scheduler's registration once, and its whole block set when Redis may lack some of it;
        False when Redis did not take them."""
        info = self.info_fn()
        try:
            async with self.writing:
                if await self.register(info) or self.index_stale:
                    await self.register_with_held_blocks(info)
            self.registered.set()
            return True
        except Exception as e:   # Redis down: keep serving, retry next beat
            log.warning("heartbeat to redis failed: %s", e)
            return False

    async def register(self, info: SchedulerInfo) -> bool:
        """True when the registration was gone: Redis restarted or was flushed, or the beats stopped for longer
        than the TTL; the block set went with it."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.exists(scheduler_key(info.scheduler_id, self.prefix))
        self.add_registration(pipe, info)
        existed, *_ = await pipe.execute()
        return not existed

    async def register_with_held_blocks(self, info: SchedulerInfo) -> None:
        """The registration, its block set replaced by what the block manager holds now. Batches queued before
        this moment are applied after it and leave it right: they are older than the state it copies, and in order."""
        key = blocks_key(info.scheduler_id, self.prefix)
        self.index_stale, held = False, list(self.held_fn())   # a batch dropped from now on marks it stale again
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)
        if held:
            pipe.sadd(key, *held)
        self.add_registration(pipe, info)
        try:
            await pipe.execute()
        except Exception:
            self.index_stale = True
            raise

    def add_registration(self, pipe: Pipeline, info: SchedulerInfo) -> None:
        """Registration and block set get one TTL, in one transaction, so they expire together (or the set one
        event write later: never more than a TTL after this scheduler's last write)."""
        registration = signed_registration(info, self.cluster_token)
        pipe.set(scheduler_key(info.scheduler_id, self.prefix), registration, px=self.ttl_ms)
        pipe.sadd(registry_key(self.prefix), info.scheduler_id)
        pipe.pexpire(blocks_key(info.scheduler_id, self.prefix), self.ttl_ms)

    async def publish_events(self) -> None:
        while True:
            batches = [await self.events.get()]
            await asyncio.sleep(self.flush_interval)
            while not self.events.empty():
                batches.append(self.events.get_nowait())
            try:
                await self.write_events(batches)
            except Exception as e:
                self.index_stale = True
                log.warning("dropping %d KV event batches, redis failed: %s", len(batches), e)

    async def write_events(self, batches: list[tuple[list[int], list[int]]]) -> None:
        """The batches' net effect in one pipeline: each block as the last batch that names it left it (a block
        may be evicted, then stored again)."""
        key = blocks_key(self.scheduler_id, self.prefix)
        stored, removed = net_events(batches)
        pipe = self.redis.pipeline(transaction=False)
        if removed:
            pipe.srem(key, *removed)
        if stored:
            pipe.sadd(key, *stored)
        pipe.pexpire(key, self.ttl_ms)   # a set these writes create expires too
        async with self.writing:
            await pipe.execute()

    async def leave(self) -> None:
        """Deregister and clear this scheduler's block set (the next beat registers it again, with its blocks)."""
        scheduler_id = self.scheduler_id
        try:
            pipe = self.redis.pipeline(transaction=True)
            pipe.srem(registry_key(self.prefix), scheduler_id)
            pipe.delete(scheduler_key(scheduler_id, self.prefix), blocks_key(scheduler_id, self.prefix))
            await pipe.execute()
        except Exception as e:
            log.warning("could not deregister from redis: %s", e)

    async def close(self) -> None:
        """Graceful shutdown: leave for good."""
        for task in self.tasks:
            task.cancel()
        await self.leave()
        await self.redis.aclose()


def net_events(batches: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """(stored, removed) in order → the blocks stored and removed once all of them are applied."""
    last: dict[int, bool] = {}
    for stored, removed in batches:
        last.update(dict.fromkeys(removed, False))
        last.update(dict.fromkeys(stored, True))
    return [h for h, held in last.items() if held], [h for h, held in last.items() if not held]
