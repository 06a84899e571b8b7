"""The tenants and multiturn workloads: deterministic, the documented shapes, loadable by name."""
from __future__ import annotations

from collections import Counter

from benchmarks.cluster.hit_rate_bounds import bounds
from benchmarks.common import workloads
from benchmarks.common.routing_workloads import MultiturnShape, TenantsShape, multiturn, tenants
from benchmarks.common.workloads import BenchRequest


def test_tenants_are_the_same_for_a_seed_and_differ_across_seeds():
    assert tenants(50, seed=3) == tenants(50, seed=3)
    assert tenants(50, seed=3) != tenants(50, seed=4)


def test_tenant_requests_share_long_prefixes_with_zipf_popularity():
    shape = TenantsShape(num_tenants=8)
    requests = tenants(2000, seed=1, shape=shape)
    by_prefix = Counter(tuple(r.prompt_token_ids[:512]) for r in requests)
    assert len(by_prefix) == 8                                   # every request starts with one of 8 prefixes
    counts = sorted(by_prefix.values(), reverse=True)
    expected_top = 1 / sum(1 / k ** 1.1 for k in range(1, 9))  # Zipf s = 1.1 over 8 tenants: ~0.38
    assert abs(counts[0] / 2000 - expected_top) < 0.04
    assert counts[0] > 3 * counts[-1]
    for r in requests:
        assert 512 + 16 <= len(r.prompt_token_ids) <= 2048 + 64 and 32 <= r.max_tokens <= 128


def test_each_multiturn_turn_extends_its_previous_prompt_and_sessions_interleave():
    requests = multiturn(300, seed=2, shape=MultiturnShape(open_sessions=4))
    last_of_session: list[list[int]] = []
    interleaved = 0
    for i, request in enumerate(requests):
        prompt = request.prompt_token_ids
        previous = [p for p in last_of_session if prompt[:len(p)] == p and len(p) < len(prompt)]
        if previous:
            parent = max(previous, key=len)
            interleaved += requests[i - 1].prompt_token_ids != parent
            last_of_session[last_of_session.index(parent)] = prompt
        else:
            last_of_session.append(prompt)
    sessions = len(last_of_session)
    assert 300 / 8 <= sessions <= 300 / 3 + 4                    # 3-8 turns each
    assert interleaved > 100                                     # a turn rarely follows its own previous turn


def test_routing_workloads_load_by_name_at_any_length():
    assert len(workloads.load("tenants", num_requests=40)) == 40
    assert len(workloads.load("multiturn", num_requests=7)) == 7


def test_hit_rate_bounds_count_one_cold_prefill_per_tenant_or_per_tenant_and_scheduler():
    prefix = list(range(1000, 1032))                          # two full blocks
    requests = [BenchRequest(prefix + [2000 + i], 8) for i in range(3)] + [BenchRequest(list(range(3000, 3033)), 8)]
    result = bounds(requests)                                  # 132 prompt tokens
    assert result["one_scheduler_per_tenant"] == round(64 / 132, 3)   # the 2nd and 3rd hit the prefix
    assert result["round_robin"] == round(32 / 132, 3)                 # only the 3rd finds it on its scheduler
