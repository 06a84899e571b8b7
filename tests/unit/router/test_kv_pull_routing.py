"""The cache-aware router's three choices for a cached prefix (issue 42): queue at its holder, go to a less loaded
scheduler that pulls it from the holder (kv_source), or go there and recompute it; and a holder's margin, which
keeps a prefix where it is cached while its holder's queue only flickers."""
from __future__ import annotations

from protos import scheduler_pb2
from protos.block_hash import hash_blocks
from protos.registration import SchedulerInfo
from router.__main__ import argument_parser, router_options
from router.core import with_kv_source
from router.kv_pull import KvPull, KvPullOptions
from router.policy import CacheAwarePolicy, RoutingInput, plan_route
from router.process import routing_policy

PREFIX = list(range(1000, 2024))          # 64 blocks of 16
PROMPT = PREFIX + list(range(3000, 3016))  # 1,040 tokens, 16 of them not cached anywhere


def info(scheduler_id: str, waiting_tokens: int = 0, loaded: tuple[str, ...] = ()) -> SchedulerInfo:
    return SchedulerInfo(scheduler_id, f"10.0.0.{len(scheduler_id)}:{7000 + int(scheduler_id[-1])}", "m", "/m", 16,
                         4096, 50_000, waiting_tokens=waiting_tokens, lora_adapters=list(loaded))


def routed(policy, cluster: list[SchedulerInfo], matched: dict[str, int], live: bool = True, adapter: str = ""):
    request = RoutingInput(PROMPT, hash_blocks(PROMPT, 16, "m", adapter=adapter), {}, matched,
                           prefix_index_live=live, adapter=adapter)
    return plan_route(policy, cluster, request)


def test_the_holder_wins_while_its_queue_is_light_and_no_pull_is_planned():
    holder, idle = info("s1", waiting_tokens=300), info("s2")
    plan = routed(CacheAwarePolicy(), [holder, idle], {"s1": 64})
    assert plan.ranked[0] is holder and plan.ranked[0].scheduler_id not in plan.pulls


def test_a_loaded_holder_loses_to_an_idle_scheduler_that_pulls_its_blocks():
    holder, idle = info("s1", waiting_tokens=1200), info("s2")    # queue < recomputing the prefix (+ margin)
    plan = routed(CacheAwarePolicy(), [holder, idle], {"s1": 64})
    assert plan.ranked[0] is idle
    assert plan.pulls == {"s2": KvPull(holder, 64)}
    assert routed(CacheAwarePolicy(kv_pull=KvPullOptions(kv_pull=False)), [holder, idle],
                  {"s1": 64}).ranked[0] is holder                 # without the pull it was cheaper to wait


def test_recompute_wins_where_the_pull_costs_as_much_as_the_prefill_or_brings_too_little():
    holder, idle = info("s1", waiting_tokens=5000), info("s2")
    slow_link = CacheAwarePolicy(kv_pull=KvPullOptions(kv_pull_cost=1.0))
    plan = routed(slow_link, [holder, idle], {"s1": 64})
    assert plan.ranked[0] is idle and plan.pulls == {}
    plan = routed(CacheAwarePolicy(), [holder, idle], {"s1": 64, "s2": 63})   # one block short: not worth a pull
    assert plan.ranked[0] is idle and plan.pulls == {}


def test_no_pull_is_planned_when_pulling_is_off_or_the_prefix_index_is_down():
    holder, idle = info("s1", waiting_tokens=5000), info("s2")
    assert routed(CacheAwarePolicy(kv_pull=KvPullOptions(kv_pull=False)), [holder, idle], {"s1": 64}).pulls == {}
    plan = routed(CacheAwarePolicy(), [holder, idle], {"s1": 64}, live=False)   # the index's word is not trusted
    assert plan.ranked[0] is idle and plan.pulls == {}


def test_blocks_of_another_adapters_chain_are_never_pulled():
    holder, idle = info("s1", waiting_tokens=5000, loaded=("a", "b")), info("s2", loaded=("a", "b"))
    held = set(hash_blocks(PROMPT, 16, "m", adapter="a"))          # the holder computed the prompt under adapter a

    def index(adapter: str) -> dict[str, int]:
        hashes = hash_blocks(PROMPT, 16, "m", adapter=adapter)
        leading = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        return {"s1": leading} if leading else {}

    assert routed(CacheAwarePolicy(), [holder, idle], index("a"), adapter="a").pulls == {"s2": KvPull(holder, 65)}
    assert routed(CacheAwarePolicy(), [holder, idle], index("b"), adapter="b").pulls == {}
    assert routed(CacheAwarePolicy(), [holder, idle], index("")).pulls == {}


def test_kv_source_goes_only_to_the_scheduler_planned_to_pull():
    holder = info("s1")
    request = scheduler_pb2.ScheduleRequest(request_id="r", prompt_token_ids=PROMPT)
    pulled = with_kv_source(request, KvPull(holder, 64))
    assert (pulled.kv_source.scheduler_id, pulled.kv_source.address, pulled.kv_source.num_blocks) == (
        "s1", holder.address, 64)
    assert not request.HasField("kv_source")                         # the request other targets get is unchanged
    assert with_kv_source(request, None) is request


def test_a_holders_momentary_queue_does_not_move_its_prefix_but_a_lasting_one_does():
    """A stale heartbeat can show the holder a queue of a few hundred tokens for a second: without a margin every
    request of the tenant in that second is recomputed elsewhere, and the second copy evicts another tenant."""
    cold = info("s2")

    def chosen(waiting: int, margin: float) -> str:
        policy = CacheAwarePolicy(kv_pull=KvPullOptions(kv_pull=False), holder_margin=margin)
        return routed(policy, [info("s1", waiting_tokens=waiting), cold], {"s1": 64}).ranked[0].scheduler_id

    flicker = [0, 300, 700, 1100, 1400]
    assert [chosen(w, 0.5) for w in flicker] == ["s1"] * 5
    assert [chosen(w, 0.0) for w in flicker] == ["s1", "s1", "s1", "s2", "s2"]
    assert chosen(2000, 0.5) == "s2"                                   # a queue longer than the prompt and half more


def test_router_flags_set_the_pull_options_of_the_cache_aware_policy():
    args = argument_parser().parse_args(["--scheduler", "h:1", "--kv-pull-cost", "0.25", "--kv-pull-min-blocks", "4"])
    policy = routing_policy(router_options(args))
    assert policy.kv_pull == KvPullOptions(kv_pull=True, kv_pull_cost=0.25, kv_pull_min_blocks=4)
    off = routing_policy(router_options(argument_parser().parse_args(["--scheduler", "h:1", "--no-kv-pull"])))
    assert not off.kv_pull.kv_pull
