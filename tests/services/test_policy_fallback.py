"""Redis down: the router's prefix lookups fail, it routes by its own history (the approximate policy) and every
request is still served, repeated prefixes still landing where they are cached."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from protos import router_pb2
from router.discovery import SchedulerDirectory, leading_matches
from tests.services_fixtures import collect, greedy, start_services


def test_leading_matches_stop_at_each_schedulers_first_missing_block():
    holders = [{"a", "b", "dead"}, {"a", "b"}, {"b"}, {"a", "b"}]
    assert leading_matches(holders, {"a", "b"}) == {"a": 2, "b": 4}
    assert leading_matches(holders, {"c"}) == {}


def test_a_directory_without_redis_reports_its_prefix_index_down():
    async def lookup() -> tuple[dict, bool]:
        directory = SchedulerDirectory(redis_url="redis://127.0.0.1:1")   # nothing listens there
        await directory.refresh()
        matches = await directory.prefix_matches("m", [1, 2, 3])
        await directory.close()
        return matches, directory.prefix_index_live

    assert asyncio.run(lookup()) == ({}, False)


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir)
    yield stack
    stack.stop()


def test_with_redis_down_every_request_is_served_and_repeats_of_a_prefix_hit_its_cache(services):
    block_size = services.scheduler_stats(services.scheduler_addresses[0]).block_size
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 400) for _ in range(8 * block_size)] for _ in range(2)]
    served: list[int] = []

    def while_down() -> None:
        time.sleep(2.5)                                    # the router's refresh and lookups find Redis gone
        before = sum(services.scheduler_stats(a).prefix_cache_hits for a in services.scheduler_addresses)
        for i in range(3):
            for prefix in prefixes:
                request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prefix + [20 + i, 30 + i]),
                                                     sampling=greedy(2))
                tokens, _, _ = collect(services.router().Generate(request, timeout=60))
                served.append(len(tokens))
        after = sum(services.scheduler_stats(a).prefix_cache_hits for a in services.scheduler_addresses)
        served.append(after - before)

    services.restart_redis(while_down)
    *tokens, hits = served
    assert tokens == [2] * 6
    assert hits >= 2 * 2 * 8 * block_size                  # each prefix's 2nd and 3rd requests found it cached
