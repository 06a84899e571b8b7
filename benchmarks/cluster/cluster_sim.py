"""A discrete-event simulation of a Ferry cluster: N real schedulers, the real routing policy, no workers.

Each scheduler is the real `scheduler.core.Scheduler` with its real BlockManager and prefix cache; a step's duration
comes from a cost model (benchmarks/cluster/cost_model.py) instead of a forward pass, and the sampled tokens are
synthetic (benchmark requests ignore EOS and run to max_tokens, so which tokens come out changes nothing). The
prefix index is what the schedulers' KV events would publish to Redis, applied as each step ends (or
`kv_event_lag_s` later: the scheduler publishes them from a task, a Redis write away); the load the router sees is
each scheduler's registration as of its last heartbeat, as of the router's last read of the registrations
(`registration_read_s`: every 0.5 s in `ferry up`, so a load the router weighs is up to a heartbeat and a read old).
Requests are routed on arrival by the same policy function `ferry up` runs, and admission control (a full queue: try
the next) is the real one. With several routers (replicas behind a load balancer) each has its own policy instance
and in-flight counts, arrivals go to them in turn, and a request's finish is told to the router that routed it. With
LoRA adapters (benchmarks/cluster/sim_adapters.py) each scheduler has device slots, a request may wait for one and
pay its adapter's load, and the heartbeats publish the resident adapters the router weighs. Where the router's plan
has the chosen scheduler pull the prompt's prefix from its holder (kv_source), the request waits for the transfer
and then finds the blocks cached (benchmarks/cluster/sim_kv_pull.py). Requests arrive at their own times (Poisson,
from the bench), or from closed-loop clients: `in_flight` of them at once, each sending its next request the moment
the last one ends, as benchmark clients and guidellm send them.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from base.config import EngineConfig
from base.sampling_params import SamplingParams
from benchmarks.cluster.cost_model import CostProfile, step_work
from benchmarks.cluster.sim_adapters import AdapterSetup
from benchmarks.cluster.sim_kv_pull import install, pin_leading, transfer_seconds
from protos import worker_pb2
from protos.block_hash import hash_blocks
from protos.registration import SchedulerInfo
from router.discovery import leading_matches
from router.kv_pull import KvPull
from router.policy import RoutingInput, RoutingPolicy, notify_finished, plan_route
from scheduler.admission import AdmissionLimits, QueueFull
from scheduler.core import Scheduler
from scheduler.presence import current_registration

MODEL = "sim"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
VOCAB = 50_000


@dataclass
class SimRequest:
    request_id: str
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    adapter: str = ""                    # the LoRA adapter it names ("": the base model)
    block_hashes: list[int] = field(default_factory=list)
    scheduler_id: str = ""
    router: int = 0                      # which router replica routed it
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    num_output_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)   # seconds between its consecutive output tokens
    rejected: bool = False


@dataclass
class SimNode:
    """One scheduler of the cluster, the step it is running, and what its last heartbeat told the router; with
    adapters, how many loads its steps made and how many requests found every slot in use."""
    scheduler_id: str
    scheduler: Scheduler
    adapters: AdapterSetup | None = None
    step: worker_pb2.StepRequest | None = None
    busy_s: float = 0.0
    adapter_loads: int = 0
    slot_waits: int = 0                  # requests that found every slot held by running ones when they arrived
    link_free_s: float = 0.0             # when its link is done sending the pulls queued on it
    pulls: int = 0                       # pulls it received, and the blocks they brought
    pulled_blocks: int = 0

    def __post_init__(self) -> None:
        self.identity = SchedulerInfo(self.scheduler_id, f"sim:{self.scheduler_id}", MODEL, MODEL, BLOCK_SIZE,
                                      MAX_MODEL_LEN, VOCAB, 0)
        self.info = self.registration()          # what the router last read
        self.published = self.info               # what the last heartbeat wrote to Redis

    def registration(self) -> SchedulerInfo:
        """What a scheduler's heartbeat writes (scheduler/presence.py), from its Stats (with its adapters)."""
        return current_registration(self.identity, self.scheduler.stats())

    def slots_taken(self, adapter: str) -> bool:
        """Whether a request for adapter must wait for a slot: not resident, and every slot runs an adapter."""
        lora = self.scheduler.lora
        in_use = {seq.lora_name for seq in self.scheduler.running if seq.lora_name}
        return adapter not in lora.resident and not lora.may_join(adapter, in_use)


@dataclass
class SimRouter:
    """One router replica: its own policy instance (its routing history) and the requests it has in flight."""
    policy: RoutingPolicy
    pending: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@dataclass
class PrefixIndex:
    """The Redis prefix index: block hash -> schedulers holding it, fed by KV events."""
    holders: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))

    def apply(self, scheduler_id: str, stored: list[int], removed: list[int]) -> None:
        for block_hash in removed:
            self.holders[block_hash].discard(scheduler_id)
        for block_hash in stored:
            self.holders[block_hash].add(scheduler_id)

    def matches(self, block_hashes: list[int], alive: set[str]) -> dict[str, int]:
        return leading_matches([self.holders.get(h, set()) for h in block_hashes], alive)


def new_node(index: int, profile: CostProfile, kv_blocks: int, announce_prompts: bool = False,
             adapters: AdapterSetup | None = None) -> SimNode:
    config = EngineConfig(max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens,
                          announce_prompts=announce_prompts, enable_lora=adapters is not None,
                          max_loras=adapters.max_loras if adapters else 1)
    model = worker_pb2.ModelInfo(num_blocks=kv_blocks, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                 model_name=MODEL)
    scheduler = Scheduler(config, model)
    if adapters is not None:
        scheduler.lora.loaded = {name: "" for name in adapters.names}
    return SimNode(f"sched-{index:02d}", scheduler, adapters)


def synthetic_result(scheduler: Scheduler, step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
    """One token for every sequence the step samples for (what the worker returns), drawn from its position."""
    result = worker_pb2.StepResult()
    for seq_id in scheduler.sampling_seq_ids(step.step_id):
        seq = scheduler.sequence(seq_id)
        result.sampled.add(seq_id=seq_id, token_id=1 + (len(seq.token_ids) * 7919 + seq.arrival) % (VOCAB - 1))
    return result


class ClusterSim:
    """Event loop: arrivals, step completions and heartbeats, in time order. `policy` is one router's policy, or
    a list of them: one per router replica, each given every len(list)-th arrival. `announce_prompts` is the
    schedulers' --announce-prompts: they publish a prompt's blocks when they admit it, not only once computed.
    `adapters`: the LoRA adapters requests may name, and each scheduler's slots for them. `timing_noise`: each
    step takes up to that fraction more or less than the cost model says, and the heartbeats start at a random
    phase (both from `seed`): what makes two runs of one load on a real cluster differ. `registration_read_s`: how
    often the router reads the registrations the heartbeats write (0: the moment they are written);
    `kv_event_lag_s`: how long after a step its KV events reach the prefix index."""

    def __init__(self, num_schedulers: int, profile: CostProfile, policy: RoutingPolicy | Sequence[RoutingPolicy],
                 kv_blocks: int = 0, heartbeat_s: float = 1.0, limits: AdmissionLimits = AdmissionLimits(),
                 announce_prompts: bool = False, adapters: AdapterSetup | None = None, timing_noise: float = 0.0,
                 seed: int = 0, registration_read_s: float = 0.0, kv_event_lag_s: float = 0.0):
        self.profile, self.heartbeat_s, self.limits, self.adapters = profile, heartbeat_s, limits, adapters
        self.registration_read_s, self.kv_event_lag_s = registration_read_s, kv_event_lag_s
        self.timing_noise, self.rng = timing_noise, random.Random(seed)
        self.routers = [SimRouter(p) for p in (policy if isinstance(policy, Sequence) else [policy])]
        self.arrivals = itertools.count()
        self.nodes = {n.scheduler_id: n for n in (new_node(i, profile, kv_blocks or profile.kv_blocks,
                                                           announce_prompts, adapters) for i in range(num_schedulers))}
        self.index = PrefixIndex()
        self.requests: dict[str, SimRequest] = {}
        self.events: list[tuple[float, int, Callable, object]] = []
        self.order = itertools.count()
        self.now = 0.0
        self.outstanding = 0
        self.closed_loop: list[SimRequest] = []   # with in_flight: the requests no client has sent yet

    def at(self, time_s: float, handler: Callable, arg: object = None) -> None:
        heapq.heappush(self.events, (time_s, next(self.order), handler, arg))

    def run(self, requests: list[SimRequest], in_flight: int = 0) -> list[SimRequest]:
        """Every request to its end; `in_flight` > 0: closed-loop clients, that many requests at once in their
        order, each sent when one ends (their arrival times are set as they are sent)."""
        for request in requests:
            request.block_hashes = hash_blocks(request.prompt, BLOCK_SIZE, MODEL, adapter=request.adapter)
            self.requests[request.request_id] = request
        if in_flight:
            self.closed_loop = list(reversed(requests))
            for _ in range(min(in_flight, len(requests))):
                self.send_next()
        else:
            for request in requests:
                self.at(request.arrival_s, self.arrive, request)
        self.outstanding = len(requests)
        self.at(self.heartbeat_s * (self.rng.random() if self.timing_noise else 1.0), self.heartbeat)
        if self.registration_read_s:   # the router started at its own moment: its reads are out of phase
            self.at(self.registration_read_s * (self.rng.random() if self.timing_noise else 0.5),
                    self.read_registrations)
        while self.events and self.outstanding:
            self.now, _, handler, arg = heapq.heappop(self.events)
            handler(arg)
        return requests

    def send_next(self, _: object = None) -> None:
        """A closed-loop client sends its next request now."""
        if self.closed_loop:
            request = self.closed_loop.pop()
            request.arrival_s = self.now
            self.at(self.now, self.arrive, request)

    def arrive(self, request: SimRequest) -> None:
        request.router = next(self.arrivals) % len(self.routers)    # the load balancer in front: round robin
        policy = self.routers[request.router].policy
        plan = plan_route(policy, [n.info for n in self.nodes.values()], self.routing_input(request))
        self.place(request, plan.ranked, plan.pulls)

    def routing_input(self, request: SimRequest) -> RoutingInput:
        router = self.routers[request.router]
        return RoutingInput(request.prompt, request.block_hashes, dict(router.pending),
                            self.index.matches(request.block_hashes, set(self.nodes)), now=self.now,
                            request_id=request.request_id, adapter=request.adapter)

    def place(self, request: SimRequest, ranked: Sequence[SchedulerInfo], pulls: dict[str, KvPull]) -> None:
        """Into the first of ranked whose queue takes it (pulling first where pulls names it), or rejected."""
        node = self.first_taker(ranked, len(request.prompt))
        if node is None:
            request.rejected = True
            self.outstanding -= 1
            self.send_next()
            return
        request.scheduler_id = node.scheduler_id
        self.routers[request.router].pending[node.scheduler_id] += 1
        node.slot_waits += bool(request.adapter) and node.slots_taken(request.adapter)
        pull = pulls.get(node.scheduler_id)
        if pull is None:
            self.admit(node, request)
        else:
            self.start_pull(node, request, self.nodes[pull.holder.scheduler_id], pull.num_blocks)

    def first_taker(self, ranked: Sequence[SchedulerInfo], prompt_tokens: int) -> SimNode | None:
        """The first of ranked whose queue takes a prompt of this many tokens (the schedulers' admission limits)."""
        for info in ranked:
            node = self.nodes[info.scheduler_id]
            try:
                self.limits.check(node.scheduler, prompt_tokens)
            except QueueFull:
                continue
            return node
        return None

    def start_pull(self, node: SimNode, request: SimRequest, holder: SimNode, num_blocks: int) -> None:
        """The holder pins what it still holds of the prefix past what the receiver has cached (only missing
        blocks are asked for, as scheduler/kv_transfer.py does) and sends it when its link is free; the request is
        held by the receiver meanwhile and joins its queue, in its place, once the blocks are there."""
        wanted = request.block_hashes[:num_blocks]
        have = len(node.scheduler.block_manager.cached_run(wanted))
        pinned = pin_leading(holder.scheduler.block_manager, wanted[have:])
        if not pinned.block_ids:   # nothing to pull: no transfer is set up
            self.admit(node, request)
            return
        self.add_request(node, request, held=True)
        start = max(self.now, holder.link_free_s)
        holder.link_free_s = start + transfer_seconds(self.profile, len(pinned.block_ids))
        self.at(holder.link_free_s, self.end_pull, (node, request, pinned))

    def end_pull(self, pulled: tuple[SimNode, SimRequest, object]) -> None:
        node, request, pinned = pulled
        pinned.release()
        node.pulls += 1
        node.pulled_blocks += install(node.scheduler.block_manager, pinned.block_hashes, self.profile.kv_block_bytes)
        node.scheduler.release_held(request.request_id)
        self.queued(node)

    def admit(self, node: SimNode, request: SimRequest) -> None:
        """Into the scheduler (its queue, where its adapter waits for a slot)."""
        self.add_request(node, request)
        self.queued(node)

    @staticmethod
    def add_request(node: SimNode, request: SimRequest, held: bool = False) -> None:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        node.scheduler.add_request(request.request_id, request.prompt, params, lora_name=request.adapter, held=held)

    def queued(self, node: SimNode) -> None:
        """A request joined the node's queue: its KV events published (as scheduler/engine_loop), a step started
        if none runs."""
        self.publish_kv_events(node)
        if node.step is None:
            self.start_step(node)

    def start_step(self, node: SimNode) -> None:
        node.step = node.scheduler.schedule()
        if node.step is None:
            return
        duration = self.profile.step_seconds(step_work(node.step)) * self.noise()
        if node.step.lora_slots:   # the worker loads them before the step's forward
            node.adapter_loads += len(node.step.lora_slots)
            duration += len(node.step.lora_slots) * self.adapters.load_s
        node.busy_s += duration
        self.at(self.now + duration, self.step_done, node)

    def noise(self) -> float:
        """A step's duration varies this much around the cost model's (a real machine's jitter), seeded."""
        return 1.0 + self.timing_noise * (2 * self.rng.random() - 1) if self.timing_noise else 1.0

    def step_done(self, node: SimNode) -> None:
        for output in node.scheduler.update(node.step, synthetic_result(node.scheduler, node.step)):
            self.on_output(output.request_id, len(output.new_token_ids), output.finish_reason is not None)
        self.publish_kv_events(node)
        self.start_step(node)

    def publish_kv_events(self, node: SimNode) -> None:
        """The scheduler's KV events since its last drain, into the prefix index now or kv_event_lag_s later."""
        events = (node.scheduler_id, *node.scheduler.drain_kv_events())
        if self.kv_event_lag_s:
            self.at(self.now + self.kv_event_lag_s, self.apply_kv_events, events)
        else:
            self.apply_kv_events(events)

    def apply_kv_events(self, events: tuple[str, list[int], list[int]]) -> None:
        self.index.apply(*events)

    def on_output(self, request_id: str, num_tokens: int, finished: bool) -> None:
        request = self.requests[request_id]
        if request.first_token_s is None:
            request.first_token_s = self.now
        elif num_tokens:
            request.token_gaps.extend([(self.now - request.last_token_s) / num_tokens] * num_tokens)
        request.last_token_s = self.now
        request.num_output_tokens += num_tokens
        if finished:
            request.finished_s = self.now
            router = self.routers[request.router]
            router.pending[request.scheduler_id] -= 1
            self.outstanding -= 1
            notify_finished(router.policy, request_id)
            self.send_next()

    def heartbeat(self, _: object = None) -> None:
        for node in self.nodes.values():
            node.published = node.registration()
            if not self.registration_read_s:
                node.info = node.published
        if self.events:   # nothing else scheduled: the run is over (or stuck, which its results will show)
            self.at(self.now + self.heartbeat_s, self.heartbeat)

    def read_registrations(self, _: object = None) -> None:
        """The router's directory refresh (router/discovery.py): what the heartbeats last wrote."""
        for node in self.nodes.values():
            node.info = node.published
        if self.events:
            self.at(self.now + self.registration_read_s, self.read_registrations)
