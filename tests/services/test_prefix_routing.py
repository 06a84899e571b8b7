"""Cache-aware routing: requests go where their prompt's prefix blocks already are, weighed against load."""
from __future__ import annotations

import os
import random
import signal

import pytest

from protos import router_pb2, scheduler_pb2_grpc
from protos.block_hash import hash_blocks
from protos.registration import SchedulerInfo
from router.policy import POLICIES, RoutingInput, cache_aware, rendezvous_weight
from tests.services_fixtures import (ConnectStream, child_pids, collect, greedy, indexed_blocks, served_alone,
                                     start_services, wait_until)


def info(scheduler_id: str, load_tokens: int = 0) -> SchedulerInfo:
    return SchedulerInfo(scheduler_id, f"{scheduler_id}:1", "m", "/m", 16, 2048, 100, running_tokens=load_tokens)


def routing(matched: dict[str, int], prompt_len: int = 256) -> RoutingInput:
    prompt = list(range(prompt_len))
    return RoutingInput(prompt, hash_blocks(prompt, 16, "m"), {}, matched)


def test_the_scheduler_holding_the_prefix_wins_unless_its_load_outweighs_the_saving():
    a, b = info("a", load_tokens=1000), info("b", load_tokens=0)
    assert cache_aware([a, b], routing({"a": 16}))[0] is a          # 256 cached tokens beat 100 of penalty
    busy = info("a", load_tokens=4000)
    assert cache_aware([busy, b], routing({"a": 16}))[0] is b       # 400 of penalty beat 256 cached tokens
    assert cache_aware([a, b], routing({"a": 4, "b": 8}))[0] is b   # the longer chain wins


def test_a_holders_running_contexts_do_not_push_a_long_cached_prompt_onto_a_cold_scheduler():
    hot, idle = info("hot", load_tokens=50_000), info("idle", load_tokens=100)
    big_hit = routing({"hot": 6000}, prompt_len=96_000)      # 5,000 tokens of penalty against a 96,000-token prefill
    assert cache_aware([hot, idle], big_hit)[0] is hot


def test_without_hits_equal_prefixes_go_to_the_same_rendezvous_winner():
    schedulers = [info(f"s{i}") for i in range(4)]
    first = routing({})
    winner = max(schedulers, key=lambda s: rendezvous_weight(s.scheduler_id, first.block_hashes[0]))
    assert all(cache_aware(schedulers, routing({}))[0] is winner for _ in range(3))


def test_round_robin_takes_turns():
    policy = POLICIES["round_robin"]()
    schedulers = [info("a"), info("b"), info("c")]
    picks = [policy(schedulers, routing({}))[0].scheduler_id for _ in range(6)]
    assert sorted(picks[:3]) == ["a", "b", "c"] and picks[3:] == picks[:3]


def test_round_robin_replicas_start_at_different_schedulers():
    schedulers = [info(f"s{i:02d}") for i in range(16)]
    firsts = {POLICIES["round_robin"]()(schedulers, routing({}))[0].scheduler_id for _ in range(8)}
    assert len(firsts) > 1   # all 8 on one scheduler: 16**-7 by chance, certain with a shared start


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir)
    yield stack
    stack.stop()


def registration(services, scheduler_id: str) -> SchedulerInfo:
    return SchedulerInfo.from_json(services.redis().get(f"ferry:scheduler:{scheduler_id}"))


def test_requests_sharing_a_prefix_land_where_it_is_cached(services):
    sched = {s: registration(services, s) for s in ("sched-0", "sched-1")}
    model, block_size = sched["sched-0"].model, sched["sched-0"].block_size
    rng = random.Random(11)
    while True:   # a prefix whose rendezvous winner is sched-0: only the prefix index can send it to sched-1
        prefix = [rng.randrange(3, 400) for _ in range(8 * block_size)]
        first_block = hash_blocks(prefix, block_size, model, sched["sched-0"].hash_seed)[0]
        if rendezvous_weight("sched-0", first_block) > rendezvous_weight("sched-1", first_block):
            break
    holder = services.scheduler_addresses[1]
    served_alone(scheduler_pb2_grpc.SchedulerStub(services.channel(holder)), prefix + [7], greedy(1), "warm")
    redis = services.redis()
    last_block = hash_blocks(prefix, block_size, model)[-1]
    wait_until(lambda: redis.sismember("ferry:blocks:sched-1", last_block), "the prefix published by sched-1")
    hits_before = [services.scheduler_stats(a).prefix_cache_hits for a in services.scheduler_addresses]
    for i in range(4):
        request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prefix + [20 + i, 30 + i]),
                                             sampling=greedy(2))
        tokens, _, _ = collect(services.router().Generate(request, timeout=60))
        assert len(tokens) == 2
    hits_after = [services.scheduler_stats(a).prefix_cache_hits for a in services.scheduler_addresses]
    assert hits_after[1] - hits_before[1] >= 4 * len(prefix)
    assert hits_after[0] == hits_before[0]


def test_an_announced_prompt_is_in_the_prefix_index_from_admission_and_leaves_it_if_aborted_uncomputed(
        tiny_llama_dir):
    """--announce-prompts: other router replicas see where a prompt went before it is computed; here nothing is,
    since the worker is stopped."""
    stack = start_services(tiny_llama_dir, 1, **{"--announce-prompts": None})
    [worker] = child_pids(stack.schedulers[0].pid)
    stream = ConnectStream(scheduler_pb2_grpc.SchedulerStub(stack.channel(stack.scheduler_addresses[0])))
    redis = stack.redis()
    os.kill(worker, signal.SIGSTOP)
    try:
        stream.submit("queued", list(range(300, 364)), greedy(4))       # 64 tokens: 4 blocks of 16
        wait_until(lambda: len(indexed_blocks(redis, "sched-0")) == 4, "the prompt's blocks published")
        stream.abort("queued")
        wait_until(lambda: not indexed_blocks(redis, "sched-0"), "the aborted prompt's blocks withdrawn")
    finally:
        os.kill(worker, signal.SIGCONT)
        stream.cancel()
        stack.stop()
