"""Routing policies on constructed cluster states: hit vs load, hot-prefix spreading, the approximate policy's
history, Redis down, random; LoRA adapters: where loaded, where resident, and the prefix chain's root."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import grpc
import pytest
import xxhash

from protos.block_hash import hash_blocks, root_hash
from protos.registration import SchedulerInfo
from router.core import RequestError, Router
from router.kv_pull import KvPullOptions
from router.policy import (ADAPTER_LOAD_TOKENS, POLICIES, CacheAwarePolicy, RoutingInput, cache_aware, policy_name,
                           rendezvous_weight, requested_adapter)
from router.routing_history import RoutingHistory

PREFIX = list(range(1000, 2024))          # 64 blocks of 16


def info(scheduler_id: str, waiting_tokens: int = 0, running_tokens: int = 0, loaded: tuple[str, ...] = (),
         resident: tuple[str, ...] = ()) -> SchedulerInfo:
    return SchedulerInfo(scheduler_id, f"{scheduler_id}:1", "m", "/m", 16, 4096, 50_000,
                         waiting_tokens=waiting_tokens, running_tokens=running_tokens, lora_adapters=list(loaded),
                         resident_lora_adapters=list(resident))


def request(prompt: list[int], matched: dict[str, int] | None = None, now: float = 0.0, live: bool = True,
            in_flight: Counter | None = None, request_id: str = "", adapter: str = "") -> RoutingInput:
    return RoutingInput(prompt, hash_blocks(prompt, 16, "m", adapter=adapter), dict(in_flight or {}), matched or {},
                        prefix_index_live=live, now=now, request_id=request_id, adapter=adapter)


def burst(policy, cluster: list[SchedulerInfo], num_requests: int, matched: dict[str, int] | None = None) -> Counter:
    """num_requests of one prefix within milliseconds, all still in flight: where each went."""
    picks: Counter = Counter()
    for i in range(num_requests):
        picks[policy(cluster, request(question(i), matched, now=0.001 * i, in_flight=picks))[0].scheduler_id] += 1
    return picks


def question(i: int) -> list[int]:
    return PREFIX + [40_000 + i] * 16


def no_pull(**fields) -> CacheAwarePolicy:
    """cache_aware with --no-kv-pull: queue at the holder or recompute elsewhere."""
    return CacheAwarePolicy(kv_pull=KvPullOptions(kv_pull=False), **fields)


def test_a_cache_hit_wins_until_the_holders_queue_outweighs_prefilling_the_prompt_elsewhere_by_the_margin():
    holder_light, cold = info("holder", waiting_tokens=1200), info("cold")   # more than the 1,040-token prompt,
    assert no_pull()([holder_light, cold], request(question(0), {"holder": 64}))[0] is holder_light   # < 1.5x
    assert no_pull(holder_margin=0.0)([holder_light, cold], request(question(0), {"holder": 64}))[0] is cold
    holder_busy = info("holder", waiting_tokens=1700)          # more than the prompt plus half the prefix
    assert no_pull()([holder_busy, cold], request(question(0), {"holder": 64}))[0] is cold


def test_a_hot_prefix_spreads_over_more_schedulers_as_its_load_grows_instead_of_piling_onto_one():
    def picks(num_requests: int, policy: CacheAwarePolicy) -> Counter:
        return burst(policy, [info(f"s{i}") for i in range(8)], num_requests, {"s0": 64})

    few = picks(16, no_pull())
    assert few["s0"] >= 10 and len(few) >= 2                   # cheap hits on the holder first, then others
    assert few["s0"] > 2 * max(n for s, n in few.items() if s != "s0")
    many = picks(60, no_pull())
    assert many["s0"] < 30 and len(many) == 8                   # the holder takes a share, not all
    assert min(many.values()) >= 2                              # every new holder is reused, not sprayed once
    pulled = picks(16, CacheAwarePolicy())                      # a pull makes a second holder sooner
    assert pulled["s0"] < few["s0"] and len(pulled) > len(few)


def test_a_burst_of_one_cold_prefix_spreads_by_the_routers_own_decisions_between_heartbeats():
    cluster = [info(f"s{i}") for i in range(4)]                # stale heartbeats: every scheduler looks idle
    assert len(burst(cache_aware, cluster, 7)) == 1            # without its own decisions: all piled onto one
    picks = burst(CacheAwarePolicy(), cluster, 7)
    assert len(picks) >= 2 and max(picks.values()) <= 5
    finished, chosen = CacheAwarePolicy(), set()              # the same prefix, each request done before the next
    for i in range(16):
        chosen.add(finished(cluster, request(question(i), now=0.001 * i, request_id=f"r{i}"))[0].scheduler_id)
        finished.finish(f"r{i}")
    assert len(chosen) == 1


def test_approximate_policy_learns_where_it_sent_a_prefix_without_any_prefix_index():
    cluster = [info(f"s{i}") for i in range(4)]
    winner = max(cluster, key=lambda c: rendezvous_weight(c.scheduler_id, hash_blocks(PREFIX, 16, "m")[0]))
    loaded = [info(c.scheduler_id, waiting_tokens=5000 if c is winner else 0) for c in cluster]
    policy = POLICIES["approximate"]()
    first = policy(loaded, request(question(0)))[0]
    assert first is not winner
    later = request(question(1), now=60.0)                     # long after: no recent work, only the history
    assert policy(cluster, later)[0].scheduler_id == first.scheduler_id
    assert POLICIES["approximate"]()(cluster, later)[0].scheduler_id == winner.scheduler_id   # a fresh one can't


def test_with_the_prefix_index_down_cache_aware_routes_by_its_own_history():
    cluster = [info(f"s{i}") for i in range(4)]
    policy = CacheAwarePolicy()
    first = policy([info(c.scheduler_id, waiting_tokens=0 if i == 2 else 900) for i, c in enumerate(cluster)],
                   request(question(0)))[0]
    assert first.scheduler_id == "s2"
    down = request(question(1), {"s3": 64}, now=60.0, live=False)   # what Redis said last is not trusted
    assert policy(cluster, down)[0].scheduler_id == "s2"
    up = request(question(2), {"s3": 64}, now=120.0, live=True)
    assert policy(cluster, up)[0].scheduler_id == "s3"


def test_where_the_index_knows_no_holder_the_router_trusts_where_it_sent_the_prefix_however_long_ago():
    cluster = [info(f"s{i}") for i in range(4)]
    winner = max(cluster, key=lambda c: rendezvous_weight(c.scheduler_id, hash_blocks(PREFIX, 16, "m")[0]))
    policy = CacheAwarePolicy()
    first = policy([info(c.scheduler_id, waiting_tokens=5000 if c is winner else 0) for c in cluster],
                   request(question(0)))[0]
    assert first is not winner
    queued = request(question(1), {}, now=30.0)                # still queued there: nothing published yet
    assert policy(cluster, queued)[0].scheduler_id == first.scheduler_id
    computed_elsewhere = request(question(2), {winner.scheduler_id: 64}, now=60.0)
    assert policy(cluster, computed_elsewhere)[0].scheduler_id == winner.scheduler_id


def test_history_forgets_the_least_recently_sent_blocks_beyond_its_capacity():
    history = RoutingHistory(capacity_blocks=64)
    old, new = hash_blocks(PREFIX, 16, "m"), hash_blocks(list(range(5000, 6024)), 16, "m")
    history.record("a", old, 10, now=0.0)
    assert history.matched_blocks(old) == {"a": 64}
    history.record("a", new, 10, now=1.0)
    assert history.matched_blocks(old) == {}
    assert history.matched_blocks(new) == {"a": 64}
    assert history.recent_work("a", now=1.5, window_s=1.0) == 10


def test_recent_work_counts_every_decision_in_the_window_until_its_request_finishes():
    history = RoutingHistory()
    for i in range(3):                                           # a burst: decided, no stream open yet
        history.record("a", hash_blocks(PREFIX, 16, "m"), 100, now=0.01 * i, request_id=f"r{i}")
    assert history.recent_work("a", now=0.1, window_s=1.0) == 300
    history.finish("r1")
    assert history.recent_work("a", now=0.1, window_s=1.0) == 200
    assert history.recent_work("a", now=2.0, window_s=1.0) == 0 and not history.unfinished


def test_random_policy_is_a_seeded_permutation_that_uses_every_scheduler():
    cluster = [info(f"s{i}") for i in range(4)]
    first, second = POLICIES["random"](7), POLICIES["random"](7)
    picks = [first(cluster, request(question(0)))[0].scheduler_id for _ in range(40)]
    assert picks == [second(cluster, request(question(0)))[0].scheduler_id for _ in range(40)]
    assert set(picks) == {"s0", "s1", "s2", "s3"}
    assert sorted(c.scheduler_id for c in first(cluster, request(question(0)))) == ["s0", "s1", "s2", "s3"]


def test_a_policys_name_is_read_without_its_repr():
    """The router names its policy in every request's span: a stateful policy's repr (all its routing history) was
    built for each request, a sixth of the router's CPU under a 32-stream load."""
    class Stateful:
        def __repr__(self):
            raise AssertionError("repr built")

        def __call__(self, candidates, request):
            return list(candidates)

    assert policy_name(Stateful()) == "Stateful"
    named = ("cache_aware", "approximate", "least_loaded", "round_robin")
    assert [policy_name(POLICIES[name]()) for name in named] == list(named)


# --- LoRA adapters -----------------------------------------------------------------------------------------
def test_a_request_names_an_adapter_by_a_model_other_than_the_base():
    served = SchedulerInfo("s", "a", "m", "/m", 16, 256, 512, model_aliases=["m-alias"])
    assert requested_adapter("", served) == "" and requested_adapter("m", served) == ""
    assert requested_adapter("m-alias", served) == ""
    assert requested_adapter("sql-lora", served) == "sql-lora"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_only_schedulers_that_have_the_requested_adapter_loaded(name: str):
    cluster = [info("idle"), info("holder", waiting_tokens=3000, loaded=("a",)), info("other", loaded=("b",)),
               info("second", waiting_tokens=6000, loaded=("a", "b"))]
    policy = POLICIES[name]()
    for i in range(6):
        ranked = policy(cluster, request(question(i), now=0.001 * i, adapter="a"))
        assert sorted(c.scheduler_id for c in ranked) == ["holder", "second"]
    assert {c.scheduler_id for c in policy(cluster, request(question(9)))} == {"idle", "holder", "other", "second"}
    assert policy(cluster, request(question(10), adapter="nowhere")) == []


def test_cache_aware_prefers_a_scheduler_where_the_adapter_is_resident():
    cluster = [info("cold", waiting_tokens=100, loaded=("a",)), info("resident", waiting_tokens=300, loaded=("a",),
                                                                      resident=("a",))]
    assert CacheAwarePolicy()(cluster, request(question(0), adapter="a"))[0].scheduler_id == "resident"
    assert cache_aware(cluster, request(question(0), adapter="a"))[0].scheduler_id == "resident"
    assert CacheAwarePolicy()(cluster, request(question(0)))[0].scheduler_id == "cold"   # the base model: no load


def test_an_overloaded_holder_of_the_adapter_loses_to_an_idle_scheduler_that_must_load_it():
    cluster = [info("idle", loaded=("a",)), info("holder", waiting_tokens=ADAPTER_LOAD_TOKENS + 500, loaded=("a",),
                                                  resident=("a",))]
    assert CacheAwarePolicy()(cluster, request(question(0), adapter="a"))[0].scheduler_id == "idle"


def test_the_adapter_blind_policy_ignores_where_the_adapter_is_resident():
    cluster = [info("cold", waiting_tokens=100, loaded=("a",)), info("resident", waiting_tokens=300, loaded=("a",),
                                                                      resident=("a",))]
    blind = CacheAwarePolicy(adapter_load_tokens=0)
    assert blind(cluster, request(question(0), adapter="a"))[0].scheduler_id == "cold"


def test_between_heartbeats_the_router_counts_the_adapter_resident_where_it_just_sent_it():
    cluster = [info(f"s{i}", loaded=("a",)) for i in range(4)]       # stale heartbeats: resident nowhere
    policy = CacheAwarePolicy()
    first = policy(cluster, request(question(0), now=0.0, adapter="a", request_id="r0"))[0].scheduler_id
    policy.finish("r0")
    other_prompt = list(range(30_000, 30_200))                        # no prefix in common with the first
    assert policy(cluster, request(other_prompt, now=0.5, adapter="a"))[0].scheduler_id == first
    after_the_window = request(other_prompt, now=5.0, adapter="a")    # by now heartbeats tell where it is
    assert policy.adapter_load(cluster, after_the_window) == {c.scheduler_id: ADAPTER_LOAD_TOKENS for c in cluster}


def test_the_base_models_root_hash_is_unchanged_and_each_adapter_roots_a_chain_of_its_own():
    assert root_hash("m", 3) == root_hash("m", 3, "") == xxhash.xxh3_64_intdigest(b"ferry:m:3")
    assert root_hash("m", 3, "a") == xxhash.xxh3_64_intdigest(b"ferry:m:3:lora:a")
    assert len({root_hash("m", 3), root_hash("m", 3, "a"), root_hash("m", 3, "b")}) == 3
    base, a, b = (hash_blocks(PREFIX, 16, "m", 3, adapter=name) for name in ("", "a", "b"))
    assert base == hash_blocks(PREFIX, 16, "m", 3)
    assert not (set(base) & set(a)) and not (set(a) & set(b))        # KV is never shared across adapters


class StaticDirectory:
    def __init__(self, schedulers: list[SchedulerInfo]):
        self.live = schedulers

    def schedulers(self) -> list[SchedulerInfo]:
        return self.live


def test_the_router_serves_an_adapter_from_the_schedulers_that_loaded_it_and_an_unknown_one_is_not_found():
    router = Router(StaticDirectory([info("s0", loaded=("a",)), info("s1", loaded=("b",)), info("s2")]))
    assert [c.scheduler_id for c in router.candidates("a")] == ["s0"]
    assert [c.scheduler_id for c in router.candidates("m")] == ["s0", "s1", "s2"]
    with pytest.raises(RequestError) as error:
        router.candidates("sql-lora")
    assert error.value.code == grpc.StatusCode.NOT_FOUND and error.value.param == "model"
    assert error.value.message == "model 'sql-lora' does not exist (serving: a, b, m)"


def test_an_adapter_this_router_loaded_or_unloaded_outlives_older_registrations(monkeypatch):
    """A registration written before a load is still read for up to a heartbeat: the router's own news wins."""
    from router import discovery

    directory = discovery.SchedulerDirectory()
    stale = SchedulerInfo("s0", "a:1", "m", "/m", 16, 64, 100, lora_adapters=["a", "b"],
                          resident_lora_adapters=["b"])
    directory.live = {"s0": stale}
    directory.adapter_changed("s0", "late", loaded=True)
    directory.adapter_changed("s0", "b", loaded=False)
    directory.live = {"s0": replace(stale)}   # a refresh that read the same old registration
    [info] = directory.schedulers()
    assert info.lora_adapters == ["a", "late"] and info.resident_lora_adapters == []
    monkeypatch.setattr(discovery, "ADAPTER_NEWS_S", -1.0)   # the news expired: registrations speak again
    assert directory.schedulers()[0].lora_adapters == ["a", "b"]
