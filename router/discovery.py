"""Which schedulers are alive: read from Redis registrations, refreshed in the background.

When Redis is unreachable the router keeps the last schedulers it saw, plus any given on its command line
(probed with Stats once so their model is known), so requests are still served.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis

from base.cluster_auth import token_metadata
from base.tls import TlsConfig
from protos import scheduler_pb2, scheduler_pb2_grpc
from protos.registry import KEY_PREFIX, SchedulerInfo, block_key, scheduler_key_pattern

log = logging.getLogger(__name__)
MAX_PREFIX_LOOKUP_BLOCKS = 512


@dataclass
class SchedulerDirectory:
    redis_url: str = ""
    static_addresses: list[str] = field(default_factory=list)
    static_model_path: str = ""
    refresh_seconds: float = 0.5
    prefix: str = KEY_PREFIX
    live: dict[str, SchedulerInfo] = field(default_factory=dict)
    static: dict[str, SchedulerInfo] = field(default_factory=dict)
    redis_ok: bool = False
    channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    prefix_index_live: bool = False   # the last prefix lookup reached Redis
    redis_password: str = ""
    cluster_token: str = ""           # presented on every call to a scheduler
    tls: TlsConfig = TlsConfig()      # with a CA: schedulers are dialed over TLS and checked against it

    def __post_init__(self) -> None:
        self.redis = (aioredis.from_url(self.redis_url, password=self.redis_password or None, socket_timeout=1.0,
                                        socket_connect_timeout=1.0) if self.redis_url else None)
        self.call_metadata = token_metadata(self.cluster_token)
        self.refreshed = asyncio.Event()

    async def start(self) -> None:
        await self.probe_static()
        await self.refresh()
        self.task = asyncio.create_task(self.keep_fresh())

    def schedulers(self) -> list[SchedulerInfo]:
        if self.redis_ok:
            return list(self.live.values())
        merged = {info.address: info for info in self.live.values()}
        merged.update({info.address: info for info in self.static.values()})
        return list(merged.values())

    def forget(self, scheduler_id: str) -> None:
        """A scheduler that refused a connection leaves the list until it registers again."""
        self.live.pop(scheduler_id, None)

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = (
                grpc.aio.secure_channel(address, self.tls.channel_credentials(), self.tls.channel_options())
                if self.tls.ca else grpc.aio.insecure_channel(address))
        return self.channels[address]

    async def keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self.refresh()

    async def refresh(self) -> None:
        if self.redis is None:
            return
        try:
            registrations = await self.read_registrations()
            self.redis_ok = True
        except Exception as e:   # keep the last known schedulers
            if self.redis_ok:
                log.warning("redis unreachable, routing to the last known schedulers: %s", e)
            self.redis_ok = False
            return
        if registrations or not self.live:
            self.live = registrations
        # else: an empty Redis (restarted, flushed) until the next heartbeats: keep the last known schedulers;
        # a dead one among them is forgotten at its first refused connection

    async def read_registrations(self) -> dict[str, SchedulerInfo]:
        keys = [key async for key in self.redis.scan_iter(match=scheduler_key_pattern(self.prefix), count=1000)]
        values = await self.redis.mget(keys) if keys else []
        infos = [SchedulerInfo.from_json(v) for v in values if v is not None]
        return {info.scheduler_id: info for info in infos}

    async def prefix_matches(self, model: str, block_hashes: list[int]) -> dict[str, int]:
        """How many leading prompt blocks each live scheduler holds: one pipelined round trip to Redis.
        Entries of schedulers that are not live are ignored; with Redis down there are no matches, and
        `prefix_index_live` says so until a lookup succeeds again."""
        if self.redis is None or not self.redis_ok:
            self.prefix_index_live = False
            return {}
        if not block_hashes:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for block_hash in block_hashes[:MAX_PREFIX_LOOKUP_BLOCKS]:
            pipe.smembers(block_key(model, block_hash, self.prefix))
        try:
            holders = await pipe.execute()
        except Exception as e:   # routing falls back to the router's own history (the approximate policy)
            log.warning("prefix lookup failed: %s", e)
            self.prefix_index_live = False
            return {}
        self.prefix_index_live = True
        return leading_matches([{m.decode() if isinstance(m, bytes) else m for m in members} for members in holders],
                               set(self.live))

    async def probe_static(self) -> None:
        for address in self.static_addresses:
            try:
                stats = await scheduler_pb2_grpc.SchedulerStub(self.channel(address)).Stats(
                    scheduler_pb2.StatsRequest(), timeout=5.0, metadata=self.call_metadata)
            except grpc.aio.AioRpcError as e:
                log.warning("scheduler %s given on the command line is not answering: %s", address, e.code().name)
                continue
            self.static[address] = SchedulerInfo(stats.scheduler_id or address, address, "", self.static_model_path,
                                                 stats.block_size, 0, 0)

    async def close(self) -> None:
        if hasattr(self, "task"):
            self.task.cancel()
        for channel in self.channels.values():
            await channel.close()
        if self.redis is not None:
            await self.redis.aclose()


def leading_matches(holders: list[set[str]], alive: set[str]) -> dict[str, int]:
    """holders[i]: the schedulers holding prompt block i; returns how many leading blocks each alive one holds
    (a chain stops at its first miss)."""
    matched: dict[str, int] = {}
    for depth, members in enumerate(holders):
        ids = {i for i in members & alive if matched.get(i, 0) == depth}
        if not ids:
            break
        for scheduler_id in ids:
            matched[scheduler_id] = depth + 1
    return matched
