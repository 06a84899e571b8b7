"""Routing policies: pick one live scheduler for a request. A policy is a plain function, so new ones plug in.

A request that names a LoRA adapter goes only to schedulers that have it loaded (every policy filters on it); the
cache-aware policy also weighs where the adapter is resident against the cost of loading it elsewhere."""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from protos.registration import SchedulerInfo
from router.kv_pull import KvPull, KvPullOptions, deepest_holder, pull_tokens, pull_worth_it
from router.routing_history import RoutingHistory


@dataclass
class RoutingInput:
    prompt_token_ids: list[int]
    block_hashes: list[int]          # chained hashes of the prompt's full blocks (protos.block_hash)
    pending: dict[str, int]          # requests this router has in flight per scheduler id
    matched_blocks: dict[str, int] = field(default_factory=dict)  # leading prompt blocks each scheduler holds
    prefix_index_live: bool = True   # False: Redis is down, matched_blocks says nothing
    now: float = field(default_factory=time.monotonic)
    request_id: str = ""             # a stateful policy is told when it ends (its `finish`)
    adapter: str = ""                # the LoRA adapter the request runs with ("": the base model)


RoutingPolicy = Callable[[Sequence[SchedulerInfo], RoutingInput], list[SchedulerInfo]]
"""Returns the candidates in order of preference (the router tries the next one if the first is unreachable)."""


@dataclass
class RoutingPlan:
    """The candidates in order of preference, and for those whose best choice is to pull the prompt's cached
    prefix from its holder, where from (by scheduler id)."""
    ranked: list[SchedulerInfo]
    pulls: dict[str, KvPull] = field(default_factory=dict)


def plan_route(policy: RoutingPolicy, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> RoutingPlan:
    """The policy's plan (CacheAwarePolicy: its `plan`, with pulls); a plain function's ranking, with none."""
    plan = getattr(policy, "plan", None)
    return plan(candidates, request) if plan is not None else RoutingPlan(policy(candidates, request))


def policy_name(policy: RoutingPolicy) -> str:
    """The name traces give the policy: its function's, or the instance's own __name__, else its class's (never its
    repr, which for a stateful policy prints all its history)."""
    return getattr(policy, "__name__", None) or type(policy).__name__


def notify_finished(policy: RoutingPolicy, request_id: str) -> None:
    """Tell a stateful policy (CacheAwarePolicy: its `finish`) that a request ended; plain functions keep no state."""
    finish = getattr(policy, "finish", None)
    if finish is not None:
        finish(request_id)


def requested_adapter(requested_model: str, served: SchedulerInfo) -> str:
    """The LoRA adapter a request names by its model (GenerateRequest.model, the OpenAI body's `model`): "" when it
    names no model or the base model the schedulers serve (by its name or another of its names)."""
    return "" if requested_model in ("", served.model, *served.model_aliases) else requested_model


def with_adapter(candidates: Sequence[SchedulerInfo], adapter: str) -> list[SchedulerInfo]:
    """The candidates that can serve `adapter`: those that have it loaded (all of them for the base model)."""
    if not adapter:
        return list(candidates)
    return [info for info in candidates if adapter in info.lora_adapters]


def rendezvous_weight(scheduler_id: str, key: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{scheduler_id}:{key}".encode())


def affinity_key(request: RoutingInput) -> int:
    if request.block_hashes:
        return request.block_hashes[0]
    return xxhash.xxh3_64_intdigest(str(request.prompt_token_ids[:16]).encode())


def least_loaded(candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
    """Fewest queued + running requests (registered load plus this router's own in-flight ones); ties go to
    the rendezvous-hash winner of the first prompt block, so equal prefixes land together."""
    key = affinity_key(request)

    def rank(info: SchedulerInfo) -> tuple[int, int]:
        load = max(info.num_waiting + info.num_running, request.pending.get(info.scheduler_id, 0))
        return load, -rendezvous_weight(info.scheduler_id, key)

    return sorted(with_adapter(candidates, request.adapter), key=rank)


RUNNING_TOKEN_WEIGHT = 0.1     # a running sequence's context token slows the steps ahead: a tenth of a prefill token
RECENT_WINDOW_S = 1.0          # a scheduler's heartbeat (ttl / 3): what the router sent since, Redis cannot know yet
ADAPTER_LOAD_TOKENS = 2048     # sending a request where its LoRA adapter is not resident, in prefill tokens: see
                               # adapter_load_work
HOLDER_MARGIN = 0.5            # leaving the prompt's deepest holder costs half the prompt tokens left behind: see
                               # spread_tokens


def uncached_tokens(info: SchedulerInfo, request: RoutingInput, matched_blocks: int) -> int:
    """Prompt tokens scheduler `info` would have to prefill (the last prompt token is always recomputed)."""
    num_prompt = len(request.prompt_token_ids)
    return num_prompt - min(matched_blocks * (info.block_size or 16), num_prompt - 1)


def adapter_load_work(info: SchedulerInfo, request: RoutingInput, load_tokens: float = ADAPTER_LOAD_TOKENS,
                      sent_there: frozenset[str] = frozenset()) -> float:
    """What making the request's LoRA adapter resident on `info` costs, in prefill tokens: nothing for the base
    model, or where the adapter is resident (as published, or where this router just sent it: `sent_there`).

    The default, 2,048 tokens, is far more than the copy (a rank-16 adapter of an 8B model, ~80 MB, crosses PCIe in
    a few ms; one of SmolLM2-135M, ~10 MB, is copied in ~2 ms on the CPU): where every device slot holds an adapter
    that running requests use, the request waits for one to drain (a whole decode: seconds), and a load evicts an
    adapter others may want next. In the cluster simulation (16 schedulers, 64 adapters, 4 slots each, `tenants`)
    512 left most of adapter-blind routing's slot waits, 2,048 halved its p90 TTFT at 1 req/s per scheduler and
    cost little at 0.5, and 8,192 passed idle schedulers over for too long (p90 up 1.4-2x at 0.5-0.75 req/s). An
    overloaded holder still loses to an idle scheduler once its queue outweighs the load."""
    if not request.adapter or request.adapter in info.resident_lora_adapters or info.scheduler_id in sent_there:
        return 0.0
    return load_tokens


def expected_work(info: SchedulerInfo, request: RoutingInput, matched_blocks: int, recent_work: int = 0,
                  adapter_load: float = 0.0) -> float:
    """Tokens a scheduler must get through before this request's first token: its queued prefill (as of its
    heartbeat, plus what this router sent it since), its running decodes' context, the request's own uncached
    prompt, and loading its LoRA adapter where not resident (`adapter_load`, from adapter_load_work). A cache hit,
    a queue and an adapter load are weighed in the same unit."""
    return load_work(info, recent_work, adapter_load) + uncached_tokens(info, request, matched_blocks)


def load_work(info: SchedulerInfo, recent_work: int = 0, adapter_load: float = 0.0) -> float:
    """expected_work without the request's own prompt: what is ahead of it there."""
    return info.waiting_tokens + recent_work + RUNNING_TOKEN_WEIGHT * info.running_tokens + adapter_load


def prompt_work(info: SchedulerInfo, request: RoutingInput, local_blocks: int, pull: KvPull | None,
                options: KvPullOptions) -> tuple[float, KvPull | None]:
    """The request's own prompt on `info`, in prefill tokens, the cheaper of recomputing what it lacks and pulling
    the holder's blocks then recomputing the rest; and the pull, where that won."""
    recompute = uncached_tokens(info, request, local_blocks)
    if not pull_worth_it(pull, info, local_blocks, options):
        return recompute, None
    pulled = uncached_tokens(info, request, pull.num_blocks) + pull_tokens(pull, info, local_blocks, options)
    return (pulled, pull) if pulled < recompute else (recompute, None)


def spread_tokens(info: SchedulerInfo, request: RoutingInput, local_blocks: int, deepest_blocks: int,
                  margin: float) -> float:
    """What leaving the scheduler that holds the most of the prompt costs beyond this request: a second copy of the
    prefix takes pool space that other prefixes then lose. `margin` of the prompt tokens `info` lacks; 0 where it
    holds as much."""
    return margin * (uncached_tokens(info, request, local_blocks) - uncached_tokens(info, request, deepest_blocks))


def rank_by_work(candidates: Sequence[SchedulerInfo], request: RoutingInput, matched: dict[str, int],
                 recent: dict[str, int], adapter_load: dict[str, float] | None = None) -> list[SchedulerInfo]:
    """plan_by_work's ranking, with no pulls and no margin for the holder."""
    return plan_by_work(candidates, request, matched, recent, adapter_load).ranked


def plan_by_work(candidates: Sequence[SchedulerInfo], request: RoutingInput, matched: dict[str, int],
                 recent: dict[str, int], adapter_load: dict[str, float] | None = None, pull: KvPull | None = None,
                 pull_options: KvPullOptions = KvPullOptions(kv_pull=False), holder_margin: float = 0.0
                 ) -> RoutingPlan:
    """Least expected work first, ties to the rendezvous winner of the first block (equal prefixes gather). Each
    scheduler's work is the lesser of its two ways to the prompt: recompute what it lacks, or pull the holder's
    blocks (`pull`: the prefix index's deepest holder) and recompute the rest; a scheduler that holds less of
    the prompt than the one holding most pays `holder_margin` of the difference on top (spread_tokens).

    No separate imbalance guard: the queue term already moves a hot prefix on once its holder's queue outweighs a
    cold prefill elsewhere. A guard on raw load tokens (queued + running context) was measured to hurt: it sent
    requests to cold schedulers whenever a holder ran long contexts, and on `tenants` in the cluster simulation
    (16 schedulers, 16 req/s) it cost 10% of the throughput and doubled p90 TTFT (BENCHMARKS.md).

    Only schedulers with the request's adapter loaded are ranked; `adapter_load`: each one's cost of making it
    resident (adapter_load_work; None: from the published resident adapters, at the default cost)."""
    key = affinity_key(request)
    serving = with_adapter(candidates, request.adapter)
    if adapter_load is None:
        adapter_load = {info.scheduler_id: adapter_load_work(info, request) for info in serving}
    deepest = max(matched.values(), default=0)
    pulls: dict[str, KvPull] = {}

    def rank(info: SchedulerInfo) -> tuple[float, int]:
        local = matched.get(info.scheduler_id, 0)
        own, pulled = prompt_work(info, request, local, pull, pull_options)
        if pulled is not None:
            pulls[info.scheduler_id] = pulled
        work = (load_work(info, recent.get(info.scheduler_id, 0), adapter_load.get(info.scheduler_id, 0.0)) + own
                + spread_tokens(info, request, local, deepest, holder_margin))
        return work, -rendezvous_weight(info.scheduler_id, key)

    return RoutingPlan(sorted(serving, key=rank), pulls)


def cache_aware(candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
    """Stateless cache-aware ranking from the prefix index alone (see CacheAwarePolicy for the router's)."""
    return rank_by_work(candidates, request, request.matched_blocks, {})


@dataclass
class CacheAwarePolicy:
    """Least expected work, with what this router knows between heartbeats: its own recent decisions, while still
    in flight, count as queued work, and as cached blocks where the prefix index cannot show them yet. A hot
    prefix therefore spreads: once its holder's queue outweighs a cold prefill elsewhere, the next request goes
    elsewhere, and the router then knows two holders. `use_prefix_index=False` is the approximate policy (history
    only, no Redis), which is also what this policy falls back to when the prefix index is down.

    A LoRA adapter is resident where the schedulers' heartbeats say so, or where this router sent a request for it
    within the window; elsewhere its load costs `adapter_load_tokens` (0: residency ignored, adapter-blind).

    With `kv_pull` on and the prefix index up, a scheduler may instead pull the prefix from the scheduler the index
    says holds most of it (router/kv_pull.py); `holder_margin`: see spread_tokens."""
    use_prefix_index: bool = True
    history: RoutingHistory = field(default_factory=RoutingHistory)
    recent_window_s: float = RECENT_WINDOW_S
    adapter_load_tokens: float = ADAPTER_LOAD_TOKENS
    adapters_sent: dict[str, dict[str, float]] = field(default_factory=dict)   # adapter -> scheduler id -> when
    kv_pull: KvPullOptions = KvPullOptions()
    holder_margin: float = HOLDER_MARGIN

    @property
    def __name__(self) -> str:
        return "cache_aware" if self.use_prefix_index else "approximate"

    def __call__(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
        return self.plan(candidates, request).ranked

    def plan(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> RoutingPlan:
        """The ranking, and the pulls; records the first choice as sent (its work and, pulled or not, its blocks)."""
        matched = self.matched_blocks(request)
        recent = {c.scheduler_id: self.history.recent_work(c.scheduler_id, request.now, self.recent_window_s)
                  for c in candidates}
        plan = plan_by_work(candidates, request, matched, recent, self.adapter_load(candidates, request),
                            self.pull_source(candidates, request), self.kv_pull, self.holder_margin)
        if plan.ranked:
            self.record(plan.ranked[0], request, matched.get(plan.ranked[0].scheduler_id, 0),
                        plan.pulls.get(plan.ranked[0].scheduler_id))
        return plan

    def pull_source(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> KvPull | None:
        """The prefix index's deepest holder of the prompt, where pulling is on and the index is up."""
        if not (self.kv_pull.kv_pull and self.use_prefix_index and request.prefix_index_live):
            return None
        return deepest_holder(candidates, request.matched_blocks)

    def record(self, chosen: SchedulerInfo, request: RoutingInput, local_blocks: int, pull: KvPull | None) -> None:
        own, _ = prompt_work(chosen, request, local_blocks, pull, self.kv_pull)
        added = own + RUNNING_TOKEN_WEIGHT * len(request.prompt_token_ids)   # its prefill, then its running context
        self.history.record(chosen.scheduler_id, request.block_hashes, round(added), request.now, request.request_id)
        if request.adapter:
            self.adapters_sent.setdefault(request.adapter, {})[chosen.scheduler_id] = request.now

    def adapter_load(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> dict[str, float]:
        """Each candidate's cost of making the request's adapter resident (nothing where it was sent lately)."""
        if not request.adapter:
            return {}
        since = request.now - self.recent_window_s
        sent_there = frozenset(scheduler_id for scheduler_id, at in self.adapters_sent.get(request.adapter, {}).items()
                               if at >= since)
        return {info.scheduler_id: adapter_load_work(info, request, self.adapter_load_tokens, sent_there)
                for info in candidates}

    def finish(self, request_id: str) -> None:
        """Called by the router when a request ends, so its work stops counting as queued."""
        self.history.finish(request_id)

    def matched_blocks(self, request: RoutingInput) -> dict[str, int]:
        """The prefix index, and where it cannot know yet what this router sent: anything sent in the last
        window (KV events not published yet), and, past the index's deepest match, where the router sent the
        rest of the prefix at any time (no scheduler has computed those blocks yet: a request holding them is
        still queued there, which under load takes longer than any window)."""
        sent = self.history.matched_blocks(request.block_hashes)
        if not (self.use_prefix_index and request.prefix_index_live):
            return sent
        indexed = request.matched_blocks
        recent = self.history.matched_blocks(request.block_hashes, request.now - self.recent_window_s)
        deepest = max(indexed.values(), default=0)
        return {s: max(indexed.get(s, 0), recent.get(s, 0), sent.get(s, 0) if sent.get(s, 0) > deepest else 0)
                for s in indexed.keys() | sent.keys()}


def random_policy(seed: int | None = None) -> RoutingPolicy:
    rng = random.Random(seed)

    def random_choice(candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
        serving = with_adapter(candidates, request.adapter)
        return rng.sample(serving, len(serving))

    return random_choice


def round_robin_policy(start: int | None = None) -> RoutingPolicy:
    """Turns over the schedulers sorted by id, from `start` (default: a random turn, so that router replicas started
    together do not all send their first requests to the same scheduler, and then their next ones to the next)."""
    turns = itertools.count(random.randrange(1 << 30) if start is None else start)

    def round_robin(candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
        ordered = sorted(with_adapter(candidates, request.adapter), key=lambda info: info.scheduler_id)
        start = next(turns) % max(1, len(ordered))
        return ordered[start:] + ordered[:start]

    return round_robin


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "cache_aware": CacheAwarePolicy,
    "least_loaded": lambda: least_loaded,
    "round_robin": round_robin_policy,
    "random": random_policy,
    "approximate": lambda: CacheAwarePolicy(use_prefix_index=False),
}
"""Factories: each router gets its own policy instance (round robin keeps a turn counter)."""
