"""The Redis registry on a real redis-server, publisher (scheduler/presence.py) against reader (router/discovery.py):
discovery reads the registry set rather than scanning the keyspace, nothing a scheduler wrote outlives its
registration, a scheduler whose registration Redis lost publishes again everything it holds, and a router takes
only registrations that are well formed and signed with its cluster token."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
import redis

from ferry.launcher import free_port
from protos.registration import SchedulerInfo
from router.discovery import SchedulerDirectory
from scheduler.presence import Registry
from tests.services_fixtures import running_redis, wait_until

TTL_S = 1.0
REGISTRY_SET = b"ferry:schedulers"
CLUSTER_TOKEN = "cluster-token-for-tests"


@pytest.fixture
def redis_url():
    with running_redis() as url:
        yield url


def info(scheduler_id: str) -> SchedulerInfo:
    return SchedulerInfo(scheduler_id, f"127.0.0.1:{free_port()}", "m", "/models/m", 16, 1024, 512)


def registry(url: str, scheduler_id: str, **options) -> Registry:
    identity = info(scheduler_id)
    return Registry(url, lambda: identity, **options)


async def discover(url: str, cluster_token: str = "") -> SchedulerDirectory:
    directory = SchedulerDirectory(url, cluster_token=cluster_token)
    await directory.refresh()
    return directory


def write_registration(client: redis.Redis, scheduler_id: str, value: str | bytes) -> None:
    """What anyone who can write to Redis can do: a registration of their own making."""
    client.set(f"ferry:scheduler:{scheduler_id}", value)
    client.sadd(REGISTRY_SET, scheduler_id)


def test_discovery_finds_the_schedulers_with_scan_and_keys_refused_by_redis(redis_url):
    redis.Redis.from_url(redis_url).execute_command("ACL", "SETUSER", "default", "-scan", "-keys")

    async def scenario() -> tuple[list[str], bool]:
        registries = [registry(redis_url, name) for name in ("a", "b")]
        for publisher in registries:
            assert await publisher.beat()
        directory = await discover(redis_url)
        for closing in (*(r.close() for r in registries), directory.close()):
            await closing
        return sorted(directory.live), directory.redis_ok

    assert asyncio.run(scenario()) == (["a", "b"], True)


def test_a_registration_that_expired_leaves_discovery_and_the_registry_set(redis_url):
    client = redis.Redis.from_url(redis_url)

    async def scenario() -> tuple[list[str], set[bytes]]:
        gone = registry(redis_url, "gone", ttl=TTL_S)
        alive = registry(redis_url, "b")
        assert await gone.beat() and await alive.beat()
        wait_until(lambda: not client.exists("ferry:scheduler:gone"), "the registration expired", timeout=TTL_S + 5)
        directory = await discover(redis_url)
        members = client.smembers(REGISTRY_SET)
        for closing in (gone.redis.aclose(), alive.close(), directory.close()):
            await closing
        return sorted(directory.live), members

    assert asyncio.run(scenario()) == (["b"], {b"b"})     # pruned by the reader that found it expired


def test_nothing_a_scheduler_wrote_outlives_its_registration_once_it_stops_beating(redis_url):
    client = redis.Redis.from_url(redis_url)

    async def publish_then_stop() -> None:
        publisher = registry(redis_url, "a", ttl=TTL_S)
        assert await publisher.beat()
        await publisher.write_events([([11, 12, 13], []), ([14], [12])])
        await publisher.redis.aclose()     # no close(): the process died, its heartbeats stopped

    asyncio.run(publish_then_stop())
    written = [key for key in client.scan_iter() if key != REGISTRY_SET]
    assert len(written) > 1       # the registration and the prefix index entries
    # Asked of Redis's clock rather than timed: each key dies at most one TTL after the last heartbeat.
    assert all(0 < client.pttl(key) <= TTL_S * 1000 for key in written), [(k, client.pttl(k)) for k in written]
    wait_until(lambda: not [key for key in client.scan_iter() if key != REGISTRY_SET], "every key expired",
               timeout=TTL_S + 5)


def test_after_redis_loses_everything_the_next_heartbeat_registers_and_publishes_every_held_block(redis_url):
    held = {11, 12, 13}

    async def scenario() -> dict[str, int]:
        publisher = registry(redis_url, "a", held_fn=lambda: held)
        assert await publisher.beat()
        await publisher.write_events([(sorted(held), [])])
        await publisher.redis.flushall()
        assert await publisher.beat()
        directory = await discover(redis_url)
        matches = await directory.prefix_matches("m", [11, 12, 13, 14])
        for closing in (publisher.close(), directory.close()):
            await closing
        return matches

    assert asyncio.run(scenario()) == {"a": 3}


def test_kv_events_of_consecutive_steps_reach_redis_as_one_write_of_their_net_effect(redis_url):
    client = redis.Redis.from_url(redis_url)

    def writes() -> int:
        return client.info("commandstats").get("cmdstat_pexpire", {}).get("calls", 0)

    async def scenario() -> tuple[set[bytes], int]:
        publisher = registry(redis_url, "a", flush_interval=0.2)
        task = asyncio.create_task(publisher.publish_events())
        before = writes()
        for stored, removed in (([11, 12], []), ([13], [12]), ([12], [11])):   # three steps' events
            publisher.push_kv_events(stored, removed)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        task.cancel()
        await publisher.redis.aclose()
        return client.smembers("ferry:blocks:a"), writes() - before

    assert asyncio.run(scenario()) == ({b"12", b"13"}, 1)


def test_a_scheduler_restarted_under_the_same_id_publishes_only_what_it_holds_now(redis_url):
    async def scenario() -> dict[str, int]:
        before = registry(redis_url, "a")
        assert await before.beat()
        await before.write_events([([11, 12, 13], [])])
        await before.redis.aclose()       # killed: its registration has not expired yet
        after = registry(redis_url, "a")
        assert await after.beat()
        await after.write_events([([11], [])])
        directory = await discover(redis_url)
        matches = await directory.prefix_matches("m", [11, 12, 13])
        for closing in (after.close(), directory.close()):
            await closing
        return matches

    assert asyncio.run(scenario()) == {"a": 1}


def test_a_scheduler_whose_connection_broke_leaves_routing_until_it_answers_again(redis_url):
    """Its registration still lives (the TTL has not run out), yet the router stops choosing it at once; a health
    check answered SERVING brings it back."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def scenario() -> list[list[str]]:
        import grpc

        server, servicer = grpc.aio.server(), health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        publisher = registry(redis_url, "flaky")
        server.add_insecure_port(publisher.info_fn().address)
        await server.start()
        await servicer.set("ferry.Scheduler", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await publisher.beat()
        directory = SchedulerDirectory(redis_url, refresh_seconds=0.05)
        await directory.refresh()
        seen = [sorted(directory.live)]
        directory.forget("flaky")
        await asyncio.sleep(0.3)                       # probed, NOT_SERVING; beats keep its registration alive
        assert await publisher.beat()
        await directory.refresh()
        seen.append(sorted(directory.live))
        await servicer.set("ferry.Scheduler", health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(0.3)
        await directory.refresh()
        seen.append(sorted(directory.live))
        for closing in (publisher.close(), directory.close(), server.stop(None)):
            await closing
        return seen

    assert asyncio.run(scenario()) == [["flaky"], [], ["flaky"]]


def test_a_router_with_the_cluster_token_takes_only_registrations_signed_with_it(redis_url):
    """Unsigned, signed with another token, or a genuine signature over an address changed since: none is dialed.
    A router without a token takes them all, as before registrations were signed."""
    client = redis.Redis.from_url(redis_url)

    async def scenario() -> tuple[list[str], bool, list[str]]:
        publishers = [registry(redis_url, "signed", cluster_token=CLUSTER_TOKEN), registry(redis_url, "unsigned"),
                      registry(redis_url, "other-token", cluster_token="not-the-cluster-token")]
        for publisher in publishers:
            assert await publisher.beat()
        genuine = json.loads(client.get("ferry:scheduler:signed"))
        write_registration(client, "forged", json.dumps({**genuine, "scheduler_id": "forged",
                                                         "address": "203.0.113.9:50052"}))
        with_token, without_token = await discover(redis_url, CLUSTER_TOKEN), await discover(redis_url)
        for closing in (*(p.close() for p in publishers), with_token.close(), without_token.close()):
            await closing
        return sorted(with_token.live), with_token.redis_ok, sorted(without_token.live)

    assert asyncio.run(scenario()) == (["signed"], True, ["forged", "other-token", "signed", "unsigned"])


def test_malformed_registrations_are_skipped_and_logged_once_while_the_others_are_found(redis_url, caplog):
    client = redis.Redis.from_url(redis_url)
    malformed = {"garbage": b"{not json", "not-utf8": b"\xff\xfe", "a-list": b"[1, 2]",
                 "partial": json.dumps({"scheduler_id": "partial", "address": "127.0.0.1:1"}),
                 "wrong-type": json.dumps({**vars(info("wrong-type")), "block_size": "16"}),
                 "other-id": json.dumps(vars(info("a")))}   # a's own registration, copied under another id

    async def scenario() -> list[tuple[list[str], bool]]:
        publishers = [registry(redis_url, name) for name in ("a", "b")]
        for publisher in publishers:
            assert await publisher.beat()
        for scheduler_id, value in malformed.items():
            write_registration(client, scheduler_id, value)
        directory = SchedulerDirectory(redis_url)
        seen = []
        for _ in range(3):   # refreshes after the first log nothing new
            await directory.refresh()
            seen.append((sorted(directory.live), directory.redis_ok))
        for closing in (*(p.close() for p in publishers), directory.close()):
            await closing
        return seen

    with caplog.at_level(logging.WARNING, logger="router.discovery"):
        assert asyncio.run(scenario()) == [(["a", "b"], True)] * 3
    warned: dict[str, list[str]] = {}
    for record in caplog.records:
        if record.name == "router.discovery":
            scheduler_id, reason = record.args
            warned.setdefault(scheduler_id, []).append(str(reason))
    reasons = {"garbage": "not JSON", "not-utf8": "not JSON", "a-list": "a JSON list, not an object",
               "partial": "no field 'model'", "wrong-type": "field 'block_size' is str, not int",
               "other-id": "it names the scheduler 'a'"}
    assert {scheduler_id: len(logged) for scheduler_id, logged in warned.items()} == dict.fromkeys(reasons, 1)
    assert all(reasons[scheduler_id] in logged[0] for scheduler_id, logged in warned.items()), warned


def test_a_scheduler_registering_again_while_a_reader_prunes_it_stays_in_the_registry_set(redis_url):
    """After Redis lost everything, a reader that found a registration gone may prune its id just as the scheduler
    registers again: the id must stay (it would otherwise be out of routing until its next beat)."""
    client = redis.Redis.from_url(redis_url)

    async def scenario() -> set[bytes]:
        publisher = registry(redis_url, "back")
        directory = SchedulerDirectory(redis_url)
        assert await publisher.beat()
        await directory.prune_expired(["back"])       # seen gone a moment ago; registered again since
        members = client.smembers(REGISTRY_SET)
        for closing in (publisher.close(), directory.close()):
            await closing
        return members

    assert asyncio.run(scenario()) == {b"back"}
