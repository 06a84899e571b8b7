"""Disaggregated prefill and decode in the cluster simulation (issue 42), as router/disaggregation.py runs it: the
first P schedulers are registered with --role prefill, the rest with --role decode.

On arrival the routing policy ranks the decode schedulers (as the router plans before the prefill), and the prompt
goes to the prefill scheduler the router's rule picks (disaggregation.rank_prefill: the prompt's deepest holder unless
its queue, the larger of its last heartbeat's and the prompt tokens in flight there, outweighs leaving it) as a
one-token request whose token nobody sees; its prefix cache serves a prompt it has seen like any other
scheduler's. When that request ends, its blocks stay cached there, and the request goes to the first decode scheduler
in the ranking whose queue takes it, naming the prefill scheduler as its kv_source: it pulls the
prompt's full blocks (all but the last token's) that it lacks over the prefill scheduler's link (sim_kv_pull.py:
one transfer at a time a link, the blocks pinned while read), then computes the rest (the last partial block) and
decodes. A prefill no prefill scheduler takes leaves the decode scheduler to compute the whole prompt. The client's
first token is the decode scheduler's.

`prefill_pick="heartbeat"` is the router's rule; `prefill_pick="in_flight"` is a what-if the router does not do: the
prefill scheduler with the fewest prompt tokens in flight there (exact with one router), blind to where prefixes are
cached.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from benchmarks.cluster.cluster_sim import BLOCK_SIZE, ClusterSim, SimNode, SimRequest
from benchmarks.cluster.sim_kv_pull import PinnedBlocks
from protos.registration import SchedulerInfo
from router.disaggregation import PREFILL_SUFFIX, rank_prefill, roles
from router.kv_pull import KvPull
from router.policy import plan_route

PREFILL_PICKS = ("heartbeat", "in_flight")


@dataclass
class Handoff:
    """A request from arrival to its end: the decode ranking planned on arrival, where its prompt was
    prefilled, and when that prefill ended."""
    request: SimRequest
    decode_ranking: list[SchedulerInfo]
    prefill_node: SimNode | None = None
    prefill_done_s: float | None = None


@dataclass
class HandoffStats:
    prefills: int = 0
    recomputed: int = 0                  # prompts no prefill scheduler took: the decode scheduler computed them
    transfers: int = 0
    transferred_blocks: int = 0          # sent over the prefill schedulers' links (the decode side lacked them)
    prefill_s: list[float] = field(default_factory=list)    # arrival to the prefill's end (its queue included)
    transfer_s: list[float] = field(default_factory=list)   # prefill's end to the decode queue (link queue included)


class DisaggregatedSim(ClusterSim):
    """ClusterSim whose first `num_prefill` schedulers only prefill and the others only decode."""

    def __init__(self, num_prefill: int, num_schedulers: int, *args, prefill_pick: str = "heartbeat", **kwargs):
        if not 0 < num_prefill < num_schedulers:
            raise ValueError(f"{num_prefill} prefill schedulers of {num_schedulers}: some of each are needed")
        if prefill_pick not in PREFILL_PICKS:
            raise ValueError(f"prefill_pick {prefill_pick!r}: one of {PREFILL_PICKS}")
        super().__init__(num_schedulers, *args, **kwargs)
        self.prefill_pick = prefill_pick
        self.prefill_tokens: dict[str, int] = defaultdict(int)   # prompt tokens in flight on each prefill scheduler
        for i, node in enumerate(self.nodes.values()):
            node.identity = replace(node.identity, role="prefill" if i < num_prefill else "decode")
            node.info = node.published = node.registration()
        self.handoffs: dict[str, Handoff] = {}
        self.stats = HandoffStats()

    def arrive(self, request: SimRequest) -> None:
        request.router = next(self.arrivals) % len(self.routers)
        router = self.routers[request.router]
        prefill_nodes, decode_nodes = roles([n.info for n in self.nodes.values()])
        plan = plan_route(router.policy, decode_nodes, self.routing_input(request))
        handoff = Handoff(request, plan.ranked)    # its pulls are the router's own plan: P/D leaves them out
        self.handoffs[request.request_id] = handoff
        handoff.prefill_node = self.take_prefill(request, self.rank_prefill(prefill_nodes, request))
        if handoff.prefill_node is None:
            self.stats.recomputed += 1
            self.place(request, handoff.decode_ranking, {})

    def rank_prefill(self, prefill_nodes: list[SchedulerInfo], request: SimRequest) -> list[SchedulerInfo]:
        if self.prefill_pick == "heartbeat":   # the router's choice
            return rank_prefill(prefill_nodes, self.routing_input(request), self.prefill_tokens)
        return sorted(prefill_nodes, key=lambda info: self.prefill_tokens[info.scheduler_id])

    def take_prefill(self, request: SimRequest, ranked: Sequence[SchedulerInfo]) -> SimNode | None:
        """The prompt as a one-token request on the first prefill scheduler whose queue takes it."""
        node = self.first_taker(ranked, len(request.prompt))
        if node is not None:
            self.routers[request.router].pending[node.scheduler_id] += 1
            self.prefill_tokens[node.scheduler_id] += len(request.prompt)
            self.stats.prefills += 1
            self.admit(node, SimRequest(request.request_id + PREFILL_SUFFIX, self.now, request.prompt, 1,
                                        request.adapter))
        return node

    def on_output(self, request_id: str, num_tokens: int, finished: bool) -> None:
        if request_id.endswith(PREFILL_SUFFIX):
            if finished:
                self.prefilled(self.handoffs[request_id.removesuffix(PREFILL_SUFFIX)])
            return
        if finished:
            del self.handoffs[request_id]
        super().on_output(request_id, num_tokens, finished)

    def prefilled(self, handoff: Handoff) -> None:
        """The prompt is cached on its prefill scheduler: on to a decode scheduler, which pulls it from there."""
        request, holder = handoff.request, handoff.prefill_node
        self.routers[request.router].pending[holder.scheduler_id] -= 1
        self.prefill_tokens[holder.scheduler_id] -= len(request.prompt)
        handoff.prefill_done_s = self.now
        self.stats.prefill_s.append(self.now - request.arrival_s)
        num_blocks = (len(request.prompt) - 1) // BLOCK_SIZE
        self.place(request, handoff.decode_ranking, {info.scheduler_id: KvPull(holder.info, num_blocks)
                                                     for info in handoff.decode_ranking})

    def admit(self, node: SimNode, request: SimRequest) -> None:
        self.note_handoff(request)
        super().admit(node, request)

    def end_pull(self, pulled: tuple[SimNode, SimRequest, PinnedBlocks]) -> None:
        self.stats.transfers += 1
        self.stats.transferred_blocks += len(pulled[2].block_ids)
        self.note_handoff(pulled[1])
        super().end_pull(pulled)

    def note_handoff(self, request: SimRequest) -> None:
        """A decode scheduler takes a prefilled request: how long after its prefill ended."""
        handoff = self.handoffs.get(request.request_id)
        if handoff is not None and handoff.prefill_done_s is not None:
            self.stats.transfer_s.append(self.now - handoff.prefill_done_s)

    def role_nodes(self, role: str) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.identity.role == role]
