"""--scheduling-policy on constructed queues: which waiting sequence each policy admits, whom it preempts, that a
flood tenant cannot hold a light one back under fair, that aging lets every band through, and that the outputs
stay those of fcfs whatever the order (preempted work is recomputed exactly)."""
from __future__ import annotations

import hashlib

import pytest

from base.sampling_params import SamplingParams
from scheduler.core import Scheduler
from scheduler.scheduling_policy import FairShare
from scheduler.sequence import Sequence, Tenancy
from tests.unit.scheduler.test_scheduler import FakeWorker, make_scheduler, run_step


def add(scheduler: Scheduler, request_id: str, prompt_len: int = 8, max_tokens: int = 4, tenant: str = "",
        priority: int = 0, weight: float = 1.0) -> None:
    # from the id's digest, not hash() (salted per process): no two prompts share a block, so no prefix-cache
    # hit makes one tenant's work cheaper in one run than in another
    digest = hashlib.sha256(request_id.encode()).digest()
    prompt = [10 + digest[j % len(digest)] % 80 for j in range(prompt_len)]
    scheduler.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                          tenancy=Tenancy(tenant, priority, weight))


def admitted_order(policy: str, requests: list[tuple[str, str, int]], **overrides) -> list[str]:
    """The order in which requests (id, tenant, priority), queued at once, first get a step, one at a time."""
    scheduler, worker = make_scheduler(scheduling_policy=policy, max_num_seqs=1, **overrides), FakeWorker()
    for request_id, tenant, priority in requests:
        add(scheduler, request_id, tenant=tenant, priority=priority)
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        for seq in scheduler.running:
            if seq.request_id not in order:
                order.append(seq.request_id)
        run_step(scheduler, worker)
    return order


QUEUE = [("a1", "a", 1), ("a2", "a", 0), ("b1", "b", 1), ("a3", "a", 0), ("b2", "b", 0)]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    assert admitted_order("fcfs", QUEUE) == ["a1", "a2", "b1", "a3", "b2"]


def test_priority_admits_the_lowest_priority_first_then_by_arrival():
    assert admitted_order("priority", QUEUE) == ["a2", "a3", "b2", "a1", "b1"]


def test_fair_alternates_between_tenants_within_a_band():
    # band 0: a2, a3 (tenant a) and b2 (tenant b): a first (arrival), then b, the least served; in band 1 b has
    # been served less than a (one request to two)
    assert admitted_order("fair", QUEUE) == ["a2", "b2", "a3", "b1", "a1"]


def test_fair_serves_tenants_in_proportion_to_their_weights():
    scheduler, worker = make_scheduler(scheduling_policy="fair", max_num_seqs=1, num_blocks=256), FakeWorker()
    for i in range(12):
        add(scheduler, f"heavy{i}", tenant="heavy", weight=2.0)
        add(scheduler, f"light{i}", tenant="light", weight=1.0)
    finished = []
    while len(finished) < 9:
        finished += [out.request_id for out in run_step(scheduler, worker) if out.finish_reason]
    assert sum(r.startswith("heavy") for r in finished) == 6   # twice the light tenant's share


def first_step_of(scheduler: Scheduler, worker: FakeWorker, request_id: str, limit: int = 500) -> int:
    """Steps that run before the one that gives request_id's sequence its first tokens."""
    for steps in range(limit):
        if any(seq.request_id == request_id for seq in scheduler.running):
            return steps
        run_step(scheduler, worker)
    raise AssertionError(f"{request_id} never ran")


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_flood_tenant_holds_a_light_one_back_no_step_under_fair(policy):
    """32 long prompts of one tenant, sent at once, take every step's budget for a long time; a light tenant's
    short request arriving among them waits for their prefill under fcfs, and not a step under fair."""
    budget = 64
    scheduler, worker = make_scheduler(scheduling_policy=policy, max_num_batched_tokens=budget, num_blocks=1024,
                                       max_model_len=256), FakeWorker()
    for i in range(32):
        add(scheduler, f"flood{i}", prompt_len=120, max_tokens=32, tenant="flood")
    for _ in range(5):
        run_step(scheduler, worker)
    add(scheduler, "light", prompt_len=8, tenant="light")
    waited = first_step_of(scheduler, worker, "light") - 1
    if policy == "fair":
        assert waited == 0   # it starts a step's budget behind the flood: its prompt goes first
    else:
        assert waited > 20   # the flood's 32 x 120 prompt tokens first: what fair is for


def test_a_tenant_back_from_idle_starts_one_step_budget_behind_the_least_served_one_not_further():
    policy = FairShare(step_budget=64)
    policy.on_arrival(Tenancy("a"))
    policy.served["a"] = 500.0
    policy.on_arrival(Tenancy("b"))
    assert policy.served["b"] == 500.0 - 65   # its first prompt goes first
    policy.on_departure(Tenancy("b"))
    policy.served["a"] = 900.0
    policy.on_arrival(Tenancy("b"))
    assert policy.served["b"] == 900.0 - 65   # its idle time earned nothing more


def test_idle_tenants_are_forgotten_once_a_return_would_lift_them_anyway():
    policy = FairShare()
    for tenant in "abc":
        policy.on_arrival(Tenancy(tenant))
    policy.served.update(a=10.0, b=20.0, c=30.0)
    policy.on_departure(Tenancy("a"))
    policy.on_departure(Tenancy("c"))
    assert set(policy.served) == {"b", "c"}   # c was served more than b: it keeps its count
    policy.on_departure(Tenancy("b"))
    assert policy.served == {}


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_a_better_priority_preempts_a_worse_running_one_when_the_pool_is_dry(policy):
    scheduler, worker = make_scheduler(scheduling_policy=policy, num_blocks=8, max_model_len=64), FakeWorker()
    add(scheduler, "batch", prompt_len=20, max_tokens=8, priority=1)
    run_step(scheduler, worker)
    add(scheduler, "urgent", prompt_len=20, max_tokens=8, priority=0)
    run_step(scheduler, worker)
    running = {seq.request_id for seq in scheduler.running}
    assert running == {"urgent"} and scheduler.counters.preemptions == 1


def test_fcfs_never_preempts_for_a_waiting_request():
    scheduler, worker = make_scheduler(scheduling_policy="fcfs", num_blocks=8, max_model_len=64), FakeWorker()
    add(scheduler, "batch", prompt_len=20, max_tokens=8, priority=1)
    run_step(scheduler, worker)
    add(scheduler, "urgent", prompt_len=20, max_tokens=8, priority=0)
    run_step(scheduler, worker)
    assert {seq.request_id for seq in scheduler.running} == {"batch"}


@pytest.mark.parametrize("aging_steps", [4, 16])
def test_aging_lets_a_worse_band_through_a_steady_stream_of_better_ones(aging_steps):
    """Priority 1 behind priority-0 arrivals every step: it runs within (1 - 0 + 1) x aging_steps steps."""
    scheduler, worker = make_scheduler(scheduling_policy="priority", max_num_seqs=1,
                                       priority_aging_steps=aging_steps), FakeWorker()
    add(scheduler, "old", priority=1)
    for step in range(10 * aging_steps):
        if any(seq.request_id == "old" for seq in scheduler.running):
            break
        add(scheduler, f"new{step}", max_tokens=1, priority=0)
        run_step(scheduler, worker)
    else:
        raise AssertionError("priority 1 starved")
    assert aging_steps <= step <= 2 * aging_steps   # not before it ties with the newcomers' band, then no later


def outputs(policy: str, num_blocks: int) -> tuple[dict[str, list[int]], int]:
    """Every request's tokens, and the preemptions it took."""
    scheduler, worker = make_scheduler(scheduling_policy=policy, num_blocks=num_blocks), FakeWorker()
    tokens: dict[str, list[int]] = {}
    for i in range(12):
        add(scheduler, f"r{i}", prompt_len=6 + 5 * i % 17, max_tokens=12, tenant="ab"[i % 2], priority=i % 3)
    while scheduler.has_unfinished_requests():
        for out in run_step(scheduler, worker):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert scheduler.block_manager.num_free_blocks == num_blocks
    return tokens, scheduler.counters.preemptions


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_any_order_and_its_preemptions_give_the_outputs_of_fcfs(policy):
    tight, preemptions = outputs(policy, 14)
    assert preemptions > 0
    assert tight == outputs("fcfs", 64)[0]


def test_fair_preempts_within_a_band_only_past_a_step_budget_of_difference():
    policy = FairShare(step_budget=64)
    params = SamplingParams(max_tokens=1)
    seq = Sequence("w/0", "w", 0, [1], 1, params, 2, Tenancy("light"))
    victim = Sequence("r/0", "r", 0, [1], 1, params, 1, Tenancy("flood"))
    worse_band = Sequence("b/0", "b", 0, [1], 1, params, 0, Tenancy("light", priority=1))
    policy.served.update(light=100.0, flood=164.0)
    assert not policy.may_preempt_for(seq, victim, step=0)   # a swap back and forth would follow
    policy.served["flood"] = 165.0
    assert policy.may_preempt_for(seq, victim, step=0)
    assert policy.may_preempt_for(seq, worse_band, step=0)   # a worse band, whoever's
    assert not policy.may_preempt_for(worse_band, seq, step=0)


def prefill_tokens(step, request_ids: set[str]) -> int:
    """Prompt tokens the step gives requests_ids' sequences (a decode's one token not counted)."""
    scheduled = [*step.new_seqs, *step.cached_seqs]
    return sum(s.num_scheduled_tokens for s in scheduled
               if s.seq_id.rpartition("/")[0] in request_ids and s.num_scheduled_tokens > 1)


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_step_that_starts_an_under_served_tenants_prompt_carries_no_work_of_the_tenants_served_more(policy):
    """A light tenant's request decodes while a flood's long prompts are chunked in; under fair its next request
    gets a step of its own prompt and its tenant's decode (the shortest wait for its first token), the flood's
    decodes and chunks the next step; under fcfs the flood's chunks take the budget first."""
    scheduler, worker = make_scheduler(scheduling_policy=policy, max_num_batched_tokens=64, num_blocks=1024,
                                       max_model_len=256), FakeWorker()
    add(scheduler, "light0", prompt_len=8, max_tokens=40, tenant="light")
    flood = {f"flood{i}" for i in range(4)}
    for request_id in sorted(flood):
        add(scheduler, request_id, prompt_len=120, max_tokens=8, tenant="flood")
    for _ in range(4):
        run_step(scheduler, worker)
    add(scheduler, "light1", prompt_len=8, tenant="light")
    step = scheduler.schedule()
    decoding = {s.seq_id for s in step.cached_seqs if s.num_scheduled_tokens == 1}
    if policy == "fair":
        assert prefill_tokens(step, {"light1"}) == 8 and prefill_tokens(step, flood) == 0
        assert decoding == {"light0/0"}   # its tenant's decode runs; the flood's sit the step out
        scheduler.update(step, worker.step(step))
        following = scheduler.schedule()
        assert prefill_tokens(following, flood) > 0 and "flood0/0" in {s.seq_id for s in following.cached_seqs}
    else:
        assert prefill_tokens(step, flood) > 0 and "flood0/0" in decoding


def test_a_light_arrival_gets_its_prompt_whole_in_a_step_the_floods_decodes_and_prompts_sit_out():
    scheduler, worker = make_scheduler(scheduling_policy="fair", max_num_batched_tokens=64, num_blocks=1024,
                                       max_model_len=256), FakeWorker()
    chats, documents = {f"chat{i}" for i in range(12)}, {f"doc{i}" for i in range(4)}
    for request_id in sorted(chats):
        add(scheduler, request_id, prompt_len=4, max_tokens=100, tenant="flood")
    run_step(scheduler, worker)   # the twelve chats' prompts (a step with nothing running before it is whole)
    for request_id in sorted(documents):
        add(scheduler, request_id, prompt_len=120, max_tokens=100, tenant="flood")
    step = scheduler.schedule()
    decoding = sum(s.num_scheduled_tokens == 1 for s in step.cached_seqs)
    assert decoding == 12 and prefill_tokens(step, documents) == 64 - 12
    scheduler.update(step, worker.step(step))
    for _ in range(10):
        run_step(scheduler, worker)
    add(scheduler, "light", prompt_len=48, tenant="light")
    step = scheduler.schedule()
    assert prefill_tokens(step, {"light"}) == 48 and len(step.cached_seqs) == 0   # the flood's decodes sit out


def test_tenants_served_alike_share_a_step_under_fair():
    """Keeping the more-served out of a step is for a tenant far behind: tenants within a step's budget of one
    another have their prompts batched together."""
    scheduler = make_scheduler(scheduling_policy="fair", max_num_batched_tokens=64)
    for tenant in "abc":
        add(scheduler, f"{tenant}0", prompt_len=8, tenant=tenant)
    assert prefill_tokens(scheduler.schedule(), {"a0", "b0", "c0"}) == 24


def test_a_step_that_starts_a_better_priority_carries_no_prefill_of_a_worse_one():
    scheduler, worker = make_scheduler(scheduling_policy="priority", max_num_batched_tokens=64, num_blocks=1024,
                                       max_model_len=256), FakeWorker()
    add(scheduler, "batch", prompt_len=200, max_tokens=4, priority=1)
    run_step(scheduler, worker)
    add(scheduler, "urgent", prompt_len=8, max_tokens=4, priority=0)
    step = scheduler.schedule()
    assert prefill_tokens(step, {"urgent"}) == 8 and prefill_tokens(step, {"batch"}) == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_a_policy_is_contended_while_it_holds_requests_it_ranks_differently(policy):
    scheduler = make_scheduler(scheduling_policy=policy)
    add(scheduler, "a", tenant="a")
    add(scheduler, "a-batch", tenant="a", priority=1)
    assert scheduler.policy.contended() == (policy != "fcfs")         # two priorities
    scheduler.abort_request("a-batch")
    assert not scheduler.policy.contended()
    add(scheduler, "b", tenant="b")
    assert scheduler.policy.contended() == (policy == "fair")         # two tenants
    scheduler.abort_request("b")
    assert not scheduler.policy.contended()
