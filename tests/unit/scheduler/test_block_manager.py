"""Block manager invariants under random workloads, and the prefix cache's hit / eviction behaviour."""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from base.config import EngineConfig
from base.sampling_params import SamplingParams
from protos import worker_pb2
from protos.block_hash import hash_blocks, root_hash
from scheduler.baselines import scheduler_for
from scheduler.block_manager import BlockManager
from scheduler.core import Scheduler
from scheduler.sequence import Sequence

BLOCK_SIZE = 4


def check_invariants(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    live = [s for s in scheduler.running]
    owners = Counter(b for s in live for b in s.block_ids[s.num_freed_blocks:])   # those before a window: given back
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), "ref count disagrees with the block tables"
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue), "free queue disagrees with ref counts"
    for seq in live:
        held = seq.block_ids[seq.num_freed_blocks:]
        assert len(set(held)) == len(held), "a sequence holds a block twice"
        first_read = seq.num_computed_tokens - bm.sliding_window + 1 if bm.sliding_window else 0
        assert seq.num_freed_blocks * BLOCK_SIZE <= max(0, first_read), "a block in reach was given back"
        # waste: no block beyond what its known tokens need, so less than one block's slots per sequence
        assert len(seq.block_ids) <= -(-seq.num_tokens // BLOCK_SIZE)
    for block_hash, block_id in bm.cached.items():
        assert bm.blocks[block_id].block_hash == block_hash
    assert sum(scheduler.seats(s) for s in live) <= scheduler.config.max_num_seqs
    assert not set(map(id, live)) & set(map(id, scheduler.waiting))
    assert bm.num_cached_free_blocks == sum(bm.blocks[b].block_hash is not None for b in bm.free_queue)


def fake_step(scheduler: Scheduler, step: worker_pb2.StepRequest, token: int) -> worker_pb2.StepResult:
    """What a worker returns: one token for every sequence whose known tokens are now all computed."""
    result = worker_pb2.StepResult()
    for seq_id in scheduler.sampling_seq_ids(step.step_id):
        result.sampled.add(seq_id=seq_id, token_id=token)
    return result


requests = st.lists(st.tuples(st.lists(st.integers(3, 12), min_size=1, max_size=30),   # prompt (few ids: sharing)
                              st.integers(1, 12),                                       # max_tokens
                              st.integers(1, 3)),                                       # n
                    min_size=1, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests, num_blocks=st.integers(12, 40), budget=st.integers(1, 64),
       prefix_caching=st.booleans(), abort_every=st.integers(0, 7), token=st.integers(3, 12),
       batching=st.sampled_from(["continuous", "static"]), window=st.sampled_from([0, 5, 8]))
def test_blocks_are_never_shared_wrongly_and_all_come_back(requests, num_blocks, budget, prefix_caching,
                                                           abort_every, token, batching, window):
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=6, enable_prefix_caching=prefix_caching,
                          batching=batching)
    model = worker_pb2.ModelInfo(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=64, eos_token_ids=[2],
                                 model_name="m", sliding_window=window)
    scheduler = scheduler_for(config, model)
    for i, (prompt, max_tokens, n) in enumerate(requests):
        scheduler.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True))
    for step_number in range(1, 500):
        step = scheduler.schedule()
        if step is None:
            break
        check_invariants(scheduler)
        scheduler.update(step, fake_step(scheduler, step, token))
        if abort_every and step_number % abort_every == 0 and scheduler.requests:
            scheduler.abort_request(next(iter(scheduler.requests)))
        check_invariants(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == num_blocks


def make_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, seq_id, 0, list(tokens), len(tokens), SamplingParams(), 0)


def computed(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_hash_chain_is_deterministic_and_salted():
    tokens = list(range(40))
    assert hash_blocks(tokens, 16, "m") == hash_blocks(tokens, 16, "m")
    assert len(hash_blocks(tokens, 16, "m")) == 2          # full blocks only
    assert hash_blocks(tokens, 16, "m") != hash_blocks(tokens, 16, "other-model")
    assert hash_blocks(tokens, 16, "m") != hash_blocks(tokens, 16, "m", seed=1)
    changed = tokens[:]; changed[0] = 99
    assert hash_blocks(changed, 16, "m")[1] != hash_blocks(tokens, 16, "m")[1]   # a block names its whole prefix


def test_full_partial_and_missed_prefix_hits():
    bm = BlockManager(16, BLOCK_SIZE, root_hash("m"))
    first = make_seq("a", list(range(10)))          # blocks: [0-3] [4-7] [8,9]
    assert bm.match_prefix(first) == []
    assert bm.allocate(first, [], 10)
    computed(bm, first)
    same = make_seq("b", list(range(10)))
    assert bm.match_prefix(same) == first.block_ids[:2]
    partial = make_seq("c", list(range(6)) + [77, 78, 79])
    assert bm.match_prefix(partial) == first.block_ids[:1]
    other = make_seq("d", [50] + list(range(1, 10)))
    assert bm.match_prefix(other) == []
    exact = make_seq("e", list(range(8)))           # the last token is always recomputed
    assert bm.match_prefix(exact) == first.block_ids[:1]


def test_shared_blocks_are_ref_counted_and_evicted_least_recently_used_tail_first():
    bm = BlockManager(6, BLOCK_SIZE, root_hash("m"))
    a = make_seq("a", list(range(12)))              # three full blocks
    bm.allocate(a, [], 12); computed(bm, a)
    b = make_seq("b", list(range(12)) + [99])
    hits = bm.match_prefix(b)
    assert hits == a.block_ids
    bm.allocate(b, hits, 1)
    assert all(bm.blocks[x].ref_count == 2 for x in a.block_ids)
    bm.free(a)
    assert all(bm.blocks[x].ref_count == 1 for x in b.block_ids[:3])
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 3
    # allocate 4 fresh blocks: the 3 never-cached first, then the cached tail block of the prefix goes first
    c = make_seq("c", [200 + i for i in range(16)])
    bm.allocate(c, [], 16)
    stored, removed = bm.drain_events()
    assert removed == [hash_blocks(list(range(12)), BLOCK_SIZE, "m")[2]]
    assert bm.counters.evictions == 1


def test_the_least_recently_freed_prefix_is_evicted_first():
    bm = BlockManager(4, BLOCK_SIZE, root_hash("m"))
    old, new = make_seq("old", list(range(8))), make_seq("new", list(range(100, 108)))
    for seq in (old, new):
        bm.allocate(seq, [], 8); computed(bm, seq)
    bm.free(old); bm.free(new)
    assert bm.num_cached_free_blocks == 4
    taker = make_seq("taker", [300, 301])
    bm.allocate(taker, [], 2)
    stored, removed = bm.drain_events()
    assert removed == [hash_blocks(list(range(8)), BLOCK_SIZE, "m")[1]]   # the older sequence's tail block
    assert len(bm.match_prefix(make_seq("again", list(range(100, 109))))) == 2
    assert len(bm.match_prefix(make_seq("old-again", list(range(9))))) == 1


class BlockPoolMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), computation, forks and frees against a simulated KV pool: every
    computed position of every live sequence must read back its own token, whoever else shares the block. Prompts
    may queue first (announced), then be admitted or abandoned; the prefix index built from the drained KV events
    must always say exactly what is cached or announced."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(24, BLOCK_SIZE, root_hash("m"), announce_prompts=True)
        self.pool: dict[tuple[int, int], int] = {}      # (block, slot) -> token whose KV is stored there
        self.live: list[Sequence] = []
        self.queued: list[Sequence] = []
        self.index: set[int] = set()                    # what a router reading the drained events believes
        self.names = iter(range(10**6))

    def write(self, seq: Sequence, num_tokens: int) -> None:
        for src, dst in self.bm.pending_copies:
            for slot in range(BLOCK_SIZE):
                if (src, slot) in self.pool:
                    self.pool[dst, slot] = self.pool[src, slot]
        self.bm.pending_copies.clear()
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + num_tokens):
            self.pool[seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE] = seq.token_ids[p]
        seq.num_computed_tokens += num_tokens
        self.bm.register_full_blocks(seq)

    @rule(tokens=st.lists(st.integers(3, 6), min_size=1, max_size=20))
    def admit(self, tokens):
        seq = make_seq(f"s{next(self.names)}", tokens)
        hits = self.bm.match_prefix(seq)
        if self.bm.allocate(seq, hits, seq.num_tokens - len(hits) * BLOCK_SIZE):
            self.live.append(seq)
            self.write(seq, seq.num_tokens - seq.num_computed_tokens)

    @rule(tokens=st.lists(st.integers(3, 6), min_size=1, max_size=20))
    def queue(self, tokens):
        seq = make_seq(f"s{next(self.names)}", tokens)
        self.bm.announce(seq)
        self.queued.append(seq)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def admit_queued(self, data):
        seq = data.draw(st.sampled_from(self.queued))
        hits = self.bm.match_prefix(seq)
        if self.bm.allocate(seq, hits, seq.num_tokens - len(hits) * BLOCK_SIZE):
            self.queued.remove(seq)
            self.live.append(seq)
            self.write(seq, seq.num_tokens - seq.num_computed_tokens)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def abandon_queued(self, data):
        self.leave(self.queued, data)

    @rule()
    def publish(self):
        stored, removed = self.bm.drain_events()
        assert not set(stored) & set(removed)
        self.index = (self.index | set(stored)) - set(removed)
        assert self.index == set(self.bm.cached) | set(self.bm.announced)
        for seq in self.queued:
            assert set(hash_blocks(seq.token_ids, BLOCK_SIZE, "m")) <= self.index, "a queued prompt is unpublished"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(3, 6))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.bm.append_slots(seq, 1):
            self.write(seq, 1)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = make_seq(f"s{next(self.names)}", parent.token_ids)
        self.bm.fork(parent, child, parent.num_tokens)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        self.leave(self.live, data)

    def leave(self, group: list[Sequence], data) -> None:
        """A queued prompt aborted or a live sequence done: its blocks and any announcement go back."""
        seq = data.draw(st.sampled_from(group))
        group.remove(seq)
        self.bm.free(seq)

    @invariant()
    def blocks_hold_what_their_owners_computed(self):
        owners = Counter(b for s in self.live for b in s.block_ids)
        for block in self.bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.bm.free_queue)
        for seq in self.live:
            assert len(set(seq.block_ids)) == len(seq.block_ids)
            assert len(seq.block_ids) <= -(-seq.num_tokens // BLOCK_SIZE)
            for p in range(seq.num_computed_tokens):
                assert self.pool[seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE] == seq.token_ids[p]

    @invariant()
    def only_queued_prompts_are_announced(self):
        assert self.bm.announced == Counter(h for s in self.queued for h in s.announced_hashes)
        assert not any(s.announced_hashes for s in self.live)

    def teardown(self):
        for seq in self.live + self.queued:
            self.bm.free(seq)
        self.live, self.queued = [], []
        assert self.bm.num_free_blocks == self.bm.num_blocks and not self.bm.announced
        self.publish()


BlockPoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_block_pool_state_machine = BlockPoolMachine.TestCase


def test_kv_events_are_netted_so_their_order_does_not_matter():
    bm = BlockManager(2, BLOCK_SIZE, root_hash("m"))
    first = make_seq("a", list(range(5)))
    bm.allocate(first, [], 5); computed(bm, first); bm.free(first)
    h = hash_blocks(list(range(5)), BLOCK_SIZE, "m")[0]
    assert bm.drain_events() == ([h], [])
    evictor = make_seq("b", [9] * 8)
    bm.allocate(evictor, [], 8); bm.free(evictor)      # evicts h
    again = make_seq("c", list(range(5)))
    bm.allocate(again, [], 5); computed(bm, again)      # stores h again
    assert bm.drain_events() == ([h], [])
    bm.free(again)
    bm.allocate(make_seq("d", [8] * 8), [], 8)          # evicts h for good
    assert bm.drain_events() == ([], [h])


def test_pulled_blocks_join_the_prefix_cache_and_pinned_ones_are_never_reused():
    """KV moving between schedulers: reserved blocks adopted under their hashes are cache hits like computed ones
    (and reported stored); a pinned cached block survives a pool that runs dry; a hash cached already is not
    taken twice."""
    bm = BlockManager(6, BLOCK_SIZE, root_hash("m"))
    hashes = hash_blocks(list(range(12)), BLOCK_SIZE, "m")
    reserved = bm.reserve(3)
    assert reserved is not None and bm.num_free_blocks == 3
    bm.adopt(reserved, hashes)
    assert bm.cached_run(hashes) == reserved and bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 3
    assert bm.drain_events() == (hashes, [])
    bm.adopt(bm.reserve(1), hashes[:1])                     # already cached: left plain free
    assert bm.cached_run(hashes) == reserved and bm.num_cached_free_blocks == 3
    bm.pin(reserved[:1])
    assert bm.reserve(6) is None
    taken = bm.reserve(5)                                   # everything but the pinned block: two hashes evicted
    assert reserved[0] not in taken and bm.cached_run(hashes) == reserved[:1]
    bm.unpin(reserved[:1])
    bm.unpin(taken)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 1
