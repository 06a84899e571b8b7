"""Disaggregated prefill and decode in the router: which schedulers prefill and which decode, the prefill's own
request (the prompt, one greedy token, the same adapter and tenant), and the prefill pick: the prompt's deepest
holder unless its queue outweighs what leaving it costs."""
from __future__ import annotations

import asyncio

from protos import common_pb2, router_pb2, scheduler_pb2
from protos.registration import SchedulerInfo
from router.core import Router
from router.disaggregation import prefill_request, rank_prefill, roles
from router.policy import RoutingInput


def scheduler(name: str, role: str = "both", waiting_tokens: int = 0) -> SchedulerInfo:
    return SchedulerInfo(name, f"{name}:1", "m", "/m", 16, 64, 100, role=role, waiting_tokens=waiting_tokens)


def test_only_a_stack_with_prefill_schedulers_and_some_that_decode_is_disaggregated():
    p, d, both = scheduler("p", "prefill"), scheduler("d", "decode"), scheduler("b")
    assert roles([p, d, both]) == ([p], [d, both])
    assert roles([d, both]) is None and roles([p]) is None


def test_the_prefill_runs_the_prompt_alone_with_one_greedy_token():
    upstream = scheduler_pb2.ScheduleRequest(request_id="r", prompt_token_ids=[1, 2, 3], tenant="t", priority=2,
                                             lora_name="a", sampling=common_pb2.SamplingParams(max_tokens=50, n=3,
                                                                                              temperature=0.7))
    request = prefill_request(upstream)
    assert (request.request_id, list(request.prompt_token_ids), request.lora_name) == ("r/prefill", [1, 2, 3], "a")
    assert (request.tenant, request.priority) == ("t", 2)
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.n) == (1, 0.0, 0)


PROMPT = list(range(160))   # ten blocks of 16: a holder of nine recomputes 16 tokens, anyone else all 160


def routing(matched: dict[str, int], prefix_index_live: bool = True) -> RoutingInput:
    return RoutingInput(PROMPT, list(range(10)), {}, matched, prefix_index_live=prefix_index_live)


def test_the_prefill_goes_to_the_scheduler_holding_the_prompts_prefix_though_another_is_idler():
    holder, idle = scheduler("holder", "prefill", 200), scheduler("idle", "prefill", 0)
    assert rank_prefill([idle, holder], routing({"holder": 9}), {}) == [holder, idle]


def test_the_prefill_leaves_the_holder_once_its_queue_outweighs_the_prefix_and_the_margin():
    holder, idle = scheduler("holder", "prefill", 300), scheduler("idle", "prefill", 0)
    assert rank_prefill([holder, idle], routing({"holder": 9}), {}) == [idle, holder]


def test_with_nothing_cached_the_prefill_scheduler_with_the_least_queued_prompt_goes_first():
    busy, idle = scheduler("busy", "prefill", 500), scheduler("idle", "prefill", 10)
    assert rank_prefill([busy, idle], routing({}), {}) == [idle, busy]


def test_prompts_in_flight_beyond_the_heartbeat_count_as_queued():
    x, y = scheduler("x", "prefill", 100), scheduler("y", "prefill", 150)
    assert rank_prefill([x, y], routing({}), {"x": 80}) == [x, y]     # the heartbeat already shows those 80
    assert rank_prefill([x, y], routing({}), {"x": 400}) == [y, x]


def test_the_prefill_pick_ignores_the_prefix_index_while_it_is_down():
    holder, idle = scheduler("holder", "prefill", 200), scheduler("idle", "prefill", 0)
    assert rank_prefill([holder, idle], routing({"holder": 9}, prefix_index_live=False), {}) == [idle, holder]


def test_the_prefill_pick_is_a_plain_function_of_its_inputs():
    holder, idle = scheduler("holder", "prefill", 200), scheduler("idle", "prefill", 0)
    request, in_flight = routing({"holder": 9}), {"idle": 50}
    first = rank_prefill([idle, holder], request, in_flight)
    assert rank_prefill([idle, holder], request, in_flight) == first
    assert (request.matched_blocks, in_flight) == ({"holder": 9}, {"idle": 50})


class PrefillHolderDirectory:
    """Two prefill schedulers, the busier holding the prompt's prefix, and two decode ones; nothing listens."""
    prefix_index_live = True

    def __init__(self, model_path: str):
        self.live = [SchedulerInfo(name, f"{name}:1", "m", model_path, 16, 1024, 256, role=role, waiting_tokens=load)
                     for name, role, load in [("holder", "prefill", 200), ("idle", "prefill", 0),
                                              ("d0", "decode", 0), ("d1", "decode", 0)]]

    def schedulers(self) -> list[SchedulerInfo]:
        return self.live

    async def prefix_matches(self, model: str, block_hashes: list[int]) -> dict[str, int]:
        return {"holder": 9}


def test_a_disaggregated_request_asks_the_policy_once_for_its_decode_pick_and_prefills_at_the_holder(
        tiny_llama_dir, monkeypatch):
    asked, handed = [], []

    def counting_policy(candidates, request):
        asked.append([c.scheduler_id for c in candidates])
        return list(candidates)

    async def prefilled(self, prefill_targets, targets, *rest):
        handed.append(([t.scheduler_id for t in prefill_targets], [t.scheduler_id for t in targets]))
        yield None

    monkeypatch.setattr(Router, "prefilled", prefilled)
    router = Router(PrefillHolderDirectory(str(tiny_llama_dir)), policy=counting_policy)
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                         sampling=common_pb2.SamplingParams(max_tokens=4))

    async def route() -> None:
        responses = await router.route(request, router.telemetry.start(None), router.key_limiter.lease(""),
                                       router.tenant_admission.ticket(router.tenants.tenant("default")))
        await responses.__anext__()

    asyncio.run(route())
    assert asked == [["d0", "d1"]]
    assert handed == [(["holder", "idle"], ["d0", "d1"])]
