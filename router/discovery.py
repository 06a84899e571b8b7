"""Which schedulers are alive: the registry set's members whose registration in Redis has not expired, refreshed
in the background; and which prompt blocks each holds.

When Redis is unreachable the router keeps the last schedulers it saw, plus any given on its command line
(probed with Stats once so their model is known), so requests are still served. A registration is checked
(protos/registration.py: well formed and, with a cluster token, signed with it) before its address is dialed or its
model path read; one that fails is skipped, and logged once while it stays bad.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from base.cluster_auth import token_metadata
from base.grpc_options import GRPC_OPTIONS, keepalive_options
from base.tls import TlsConfig
from protos import scheduler_pb2, scheduler_pb2_grpc
from protos.registration import (KEY_PREFIX, SchedulerInfo, blocks_key, registry_key, scheduler_key,
                                  verified_registration)

log = logging.getLogger(__name__)
MAX_PREFIX_LOOKUP_BLOCKS = 512
# how long this router trusts a LoRA load or unload it made over the registrations it reads: a registration written
# before the change may still be read for up to a heartbeat after it (router/lora_admin.py)
ADAPTER_NEWS_S = 10.0
# KEYS: block sets of schedulers; ARGV: a prompt's block hashes in order. Per set, how many leading hashes it holds:
# a chain stops at its first miss. (Plain SISMEMBER: SMISMEMBER needs Redis 6.2, and would test every hash.)
# KEYS[1]: the registry set; ARGV: ids whose registration was gone. Each leaves the set only if its registration is
# still gone now: one that registered again in between (after Redis lost everything, say) stays.
PRUNE_EXPIRED_SCRIPT = """
for i, scheduler_id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then redis.call('SREM', KEYS[1], scheduler_id) end
end
"""
LEADING_BLOCKS_SCRIPT = """
local counts = {}
for i, key in ipairs(KEYS) do
  local held = 0
  while held < #ARGV and redis.call('SISMEMBER', key, ARGV[held + 1]) == 1 do held = held + 1 end
  counts[i] = held
end
return counts
"""


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
    keepalive_s: float = 10.0         # a scheduler silent this long is pinged, and dead if still silent after as long
    lost: dict[str, asyncio.Task] = field(default_factory=dict)   # out of routing until their probe succeeds
    rejected: set[str] = field(default_factory=set)   # ids whose registration failed its check (already logged)
    adapter_news: dict[str, dict[str, tuple[bool, float]]] = field(default_factory=dict)   # id -> adapter ->
    #                                                       (loaded, when): this router's own loads and unloads

    def __post_init__(self) -> None:
        self.redis = (aioredis.from_url(self.redis_url, password=self.redis_password or None, socket_timeout=1.0,
                                        socket_connect_timeout=1.0) if self.redis_url else None)
        self.leading_blocks = self.redis.register_script(LEADING_BLOCKS_SCRIPT) if self.redis else None
        self.prune_script = self.redis.register_script(PRUNE_EXPIRED_SCRIPT) if self.redis else None
        self.call_metadata = token_metadata(self.cluster_token)
        self.refreshed = asyncio.Event()

    async def start(self) -> None:
        await self.probe_static()
        await self.refresh()
        self.task = asyncio.create_task(self.keep_fresh())

    def schedulers(self) -> list[SchedulerInfo]:
        if self.redis_ok:
            infos = list(self.live.values())
        else:
            merged = {info.address: info for info in self.live.values()}
            merged.update({info.address: info for info in self.static.values()})
            infos = list(merged.values())
        return [self.with_adapter_news(info) for info in infos] if self.adapter_news else infos

    def adapter_changed(self, scheduler_id: str, adapter: str, loaded: bool) -> None:
        """This router just loaded (or unloaded) adapter there: so it is, whatever older registrations say."""
        self.adapter_news.setdefault(scheduler_id, {})[adapter] = (loaded, time.monotonic())

    def with_adapter_news(self, info: SchedulerInfo) -> SchedulerInfo:
        news = self.adapter_news.get(info.scheduler_id)
        if not news:
            return info
        now = time.monotonic()
        for adapter in [a for a, (_, since) in news.items() if now - since > ADAPTER_NEWS_S]:
            del news[adapter]
        loaded = {a for a, (is_loaded, _) in news.items() if is_loaded}
        gone = set(news) - loaded
        return replace(info, lora_adapters=[a for a in info.lora_adapters if a not in gone]
                       + sorted(loaded - set(info.lora_adapters)),
                       resident_lora_adapters=[a for a in info.resident_lora_adapters if a not in gone])

    def forget(self, scheduler_id: str) -> None:
        """A scheduler whose connection broke or was refused leaves routing now, not when its registration
        expires: until it answers a health check SERVING again, or its registration is gone."""
        info = self.live.pop(scheduler_id, None)
        if info is not None and scheduler_id not in self.lost:
            self.lost[scheduler_id] = asyncio.create_task(self.probe_until_serving(info))

    async def probe_until_serving(self, info: SchedulerInfo) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel(info.address))
        request = health_pb2.HealthCheckRequest(service="ferry.Scheduler")
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                if (await stub.Check(request, timeout=1.0)).status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
        del self.lost[info.scheduler_id]
        log.warning("scheduler %s at %s answers again: back in routing", info.scheduler_id, info.address)

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            options = GRPC_OPTIONS + keepalive_options(self.keepalive_s)
            self.channels[address] = (
                grpc.aio.secure_channel(address, self.tls.channel_credentials(), options + self.tls.channel_options())
                if self.tls.ca else grpc.aio.insecure_channel(address, options))
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
        for scheduler_id in [i for i in self.lost if i not in registrations]:   # expired or deregistered: a
            self.lost.pop(scheduler_id).cancel()                               # fresh registration is news
        if registrations or not self.live:
            self.live = {i: info for i, info in registrations.items() if i not in self.lost}
        # else: an empty Redis (restarted, flushed) until the next heartbeats: keep the last known schedulers;
        # a dead one among them is forgotten at its first refused connection

    async def read_registrations(self) -> dict[str, SchedulerInfo]:
        """The registry set's members and their registrations: two commands, whatever else the keyspace holds."""
        members = await self.redis.smembers(registry_key(self.prefix))
        ids = sorted(member.decode(errors="replace") for member in members)
        values = await self.redis.mget([scheduler_key(i, self.prefix) for i in ids]) if ids else []
        await self.prune_expired([i for i, value in zip(ids, values) if value is None])
        self.rejected.intersection_update(ids)
        infos = [self.checked(i, value) for i, value in zip(ids, values) if value is not None]
        return {info.scheduler_id: info for info in infos if info is not None}

    def checked(self, scheduler_id: str, registration: bytes) -> SchedulerInfo | None:
        """The registration when it passes its check; else None, logged when it starts failing."""
        try:
            info = verified_registration(registration, self.cluster_token)
            if info.scheduler_id != scheduler_id:
                raise ValueError(f"it names the scheduler {info.scheduler_id!r}")
        except ValueError as e:
            if scheduler_id not in self.rejected:
                log.warning("ignoring the registration of scheduler %r: %s", scheduler_id, e)
                self.rejected.add(scheduler_id)
            return None
        self.rejected.discard(scheduler_id)
        return info

    async def prune_expired(self, scheduler_ids: list[str]) -> None:
        """Registrations expired: their ids leave the registry set, atomically with a check that each is still
        gone (one registering again in between stays)."""
        if scheduler_ids:
            keys = [registry_key(self.prefix), *(scheduler_key(i, self.prefix) for i in scheduler_ids)]
            await self.prune_script(keys=keys, args=scheduler_ids)

    async def prefix_matches(self, model: str, block_hashes: list[int]) -> dict[str, int]:
        """How many leading prompt blocks each live scheduler of the model holds: one round trip to Redis.
        With Redis down there are no matches, and `prefix_index_live` says so until a lookup succeeds again."""
        if self.redis is None or not self.redis_ok:
            self.prefix_index_live = False
            return {}
        scheduler_ids = [i for i, info in self.live.items() if info.model == model]
        if not block_hashes or not scheduler_ids:
            return {}
        try:
            counts = await self.leading_blocks(keys=[blocks_key(i, self.prefix) for i in scheduler_ids],
                                               args=block_hashes[:MAX_PREFIX_LOOKUP_BLOCKS])
        except Exception as e:   # routing falls back to the router's own history (the approximate policy)
            log.warning("prefix lookup failed: %s", e)
            self.prefix_index_live = False
            return {}
        self.prefix_index_live = True
        return {scheduler_id: count for scheduler_id, count in zip(scheduler_ids, counts) if count}

    async def probe_static(self) -> None:
        for address in self.static_addresses:
            try:
                stats = await scheduler_pb2_grpc.SchedulerStub(self.channel(address)).Stats(
                    scheduler_pb2.StatsRequest(), timeout=5.0, metadata=self.call_metadata)
            except grpc.aio.AioRpcError as e:
                log.warning("scheduler %s given on the command line is not answering: %s", address, e.code().name)
                continue
            self.static[address] = SchedulerInfo(stats.scheduler_id or address, address, "", self.static_model_path,
                                                 stats.block_size, 0, 0, lora_adapters=list(stats.lora_adapters))

    async def close(self) -> None:
        if hasattr(self, "task"):
            self.task.cancel()
        for probe in self.lost.values():
            probe.cancel()
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
