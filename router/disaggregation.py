"""Disaggregated prefill and decode (schedulers registered with --role prefill / decode): a request's prompt is
computed on a prefill scheduler, then the request runs on a decode scheduler that pulls the prompt's KV from it
(ScheduleRequest.kv_source, scheduler/kv_transfer.py) and generates, as vLLM's disaggregated-prefill proxy does:
the prefill runs the request with one greedy token out, which nobody sees, and leaves the prompt's blocks in its
prefix cache; the decode scheduler gets the request as it came, with the holder named. Its output is what one
scheduler would have produced (the pulled blocks are exactly the ones it would have computed). Both are chosen
by load: the prefill scheduler by the cache-aware policy's weighing of queue against cached prefix (rank_prefill),
the decode one by the routing policy among those that decode. A prefill that fails leaves the decode scheduler to
compute the prompt itself: no request fails for it."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from protos import common_pb2, scheduler_pb2
from protos.registration import SchedulerInfo
from router.policy import HOLDER_MARGIN, RoutingInput, plan_by_work
from router.upstream import SchedulerConnection, UpstreamError

log = logging.getLogger(__name__)
PREFILL_SUFFIX = "/prefill"


def roles(candidates: Sequence[SchedulerInfo]) -> tuple[list[SchedulerInfo], list[SchedulerInfo]] | None:
    """(prefill schedulers, those that decode) where the candidates are disaggregated; None where they are not (no
    prefill scheduler, or none left to decode)."""
    prefill = [c for c in candidates if c.role == "prefill"]
    decode = [c for c in candidates if c.role != "prefill"]
    return (prefill, decode) if prefill and decode else None


def rank_prefill(schedulers: Sequence[SchedulerInfo], request: RoutingInput, in_flight_tokens: dict[str, int]
                 ) -> list[SchedulerInfo]:
    """Least expected work first, weighed as the cache-aware policy weighs it (policy.plan_by_work): a scheduler's
    queue plus the prompt tokens it lacks, and one that holds less of the prompt than its deepest holder pays
    HOLDER_MARGIN of the difference, so a prefix stays where it is cached unless the queues say otherwise.

    A queue is the larger of its heartbeat's and the prompt tokens this router has in flight there
    (`in_flight_tokens`): both count the same prompts once a heartbeat has seen them. A plain function of its
    inputs: the routing policy, which keeps state per request id, is asked once a request, for its decode pick."""
    matched = request.matched_blocks if request.prefix_index_live else {}
    beyond_heartbeat = {s.scheduler_id: max(0, in_flight_tokens.get(s.scheduler_id, 0) - s.waiting_tokens)
                        for s in schedulers}
    return plan_by_work(schedulers, request, matched, beyond_heartbeat, holder_margin=HOLDER_MARGIN).ranked


def prefill_request(upstream: scheduler_pb2.ScheduleRequest) -> scheduler_pb2.ScheduleRequest:
    """The request as its prefill scheduler runs it: its prompt (and adapter, cache salt, tenant and priority), one
    greedy token out."""
    return scheduler_pb2.ScheduleRequest(
        request_id=upstream.request_id + PREFILL_SUFFIX, prompt_token_ids=upstream.prompt_token_ids,
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        tenant=upstream.tenant, priority=upstream.priority, tenant_weight=upstream.tenant_weight,
        lora_name=upstream.lora_name, cache_salt=upstream.cache_salt)


async def prefill(targets: Sequence[SchedulerInfo], upstream: scheduler_pb2.ScheduleRequest, block_size: int,
                  connect: Callable[[str], SchedulerConnection], trace_context: dict[str, str]
                  ) -> scheduler_pb2.KvSource | None:
    """Run the prompt on the first of targets that takes it (the next if one fails); the KvSource naming the one
    that computed it, or None where none did (the decode scheduler then computes the prompt)."""
    request = prefill_request(upstream)
    num_blocks = (len(upstream.prompt_token_ids) - 1) // block_size
    for target in targets:
        running = connect(target.address).submit(request, trace_context)
        try:
            async for _ in running:
                pass
        except UpstreamError as e:
            log.warning("prefill of %s on %s failed (%s): trying the next", upstream.request_id, target.scheduler_id,
                        e.message)
            continue
        finally:
            running.close()
        return scheduler_pb2.KvSource(scheduler_id=target.scheduler_id, address=target.address, num_blocks=num_blocks)
    return None
