"""Disaggregated prefill and decode in the router: which schedulers prefill and which decode, the prefill's own
request (the prompt, one greedy token, the same adapter and tenant), and the prefill scheduler with the least
queued prompt first."""
from __future__ import annotations

from protos import common_pb2, scheduler_pb2
from protos.registration import SchedulerInfo
from router.disaggregation import least_loaded, prefill_request, roles


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


def test_the_prefill_scheduler_with_the_least_queued_prompt_goes_first():
    busy, idle = scheduler("busy", "prefill", 500), scheduler("idle", "prefill", 10)
    assert least_loaded([busy, idle], {}) == [idle, busy]
    assert least_loaded([scheduler("x", "prefill"), scheduler("y", "prefill")], {"x": 2})[0].scheduler_id == "y"
