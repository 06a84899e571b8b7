"""`ferry bench hit-rate-bounds`: the best prefix hit rate any policy can reach on `tenants` over 2 schedulers
whose pools never evict.

A request can hit at most its tenant's prefix (in full blocks; the last prompt token is always recomputed), and only
once that prefix was prefilled on the same scheduler. Sending each tenant to one scheduler (the best cache-aware
routing can do) costs one cold prefill per tenant; round robin alternates every request between the two, so a
tenant seen more than once is cold on both. Hit rate = hit tokens / prompt tokens, as the schedulers count it.

    ferry bench hit-rate-bounds 60 200 1000
"""
from __future__ import annotations

from collections import defaultdict

from benchmarks.common.cli_args import bench_parser
from benchmarks.common.routing_workloads import tenants
from benchmarks.common.workloads import BenchRequest

BLOCK_SIZE = 16
TENANT_KEY_TOKENS = 16      # tenants' prefixes are random: their first block tells them apart


def common_prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def tenant_key(request: BenchRequest) -> tuple[int, ...]:
    return tuple(request.prompt_token_ids[:TENANT_KEY_TOKENS])


def tenant_prefix_blocks(requests: list[BenchRequest]) -> list[int]:
    """Per request: the full blocks of the prefix it shares with the other requests of its tenant (0: alone)."""
    by_tenant: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, request in enumerate(requests):
        by_tenant[tenant_key(request)].append(i)
    blocks = [0] * len(requests)
    for members in by_tenant.values():
        if len(members) < 2:
            continue
        first = requests[members[0]].prompt_token_ids
        shared = min(common_prefix_length(first, requests[i].prompt_token_ids) for i in members[1:])
        for i in members:
            blocks[i] = min(shared // BLOCK_SIZE, (len(requests[i].prompt_token_ids) - 1) // BLOCK_SIZE)
    return blocks


def bounds(requests: list[BenchRequest]) -> dict[str, float]:
    blocks = tenant_prefix_blocks(requests)
    keys = [tenant_key(r) for r in requests]
    total = sum(len(r.prompt_token_ids) for r in requests)
    seen_once: set[tuple[int, ...]] = set()
    seen_per_scheduler: set[tuple[tuple[int, ...], int]] = set()
    affinity_hits = alternating_hits = 0
    for i, (key, shared) in enumerate(zip(keys, blocks)):
        affinity_hits += shared * BLOCK_SIZE if key in seen_once else 0
        alternating_hits += shared * BLOCK_SIZE if (key, i % 2) in seen_per_scheduler else 0
        seen_once.add(key)
        seen_per_scheduler.add((key, i % 2))
    return {"num_requests": len(requests), "one_scheduler_per_tenant": round(affinity_hits / total, 3),
            "round_robin": round(alternating_hits / total, 3),
            "ratio": round(affinity_hits / alternating_hits, 3) if alternating_hits else float("inf")}



def main(argv: list[str]) -> int:
    parser = bench_parser("hit-rate-bounds", __doc__)
    parser.add_argument("num_requests", type=int, nargs="*", default=[60, 200, 1000])
    for n in parser.parse_args(argv).num_requests:
        print(bounds(tenants(max(n, 512))[:n]))   # the requests `ferry bench prefix` sends
    return 0
