"""Speculative decoding in the scheduler: prompt-lookup proposals verified by a fake worker whose "model" copies
its prompt with a fresh token now and then, so proposals are often kept and sometimes rejected."""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

import pytest

from base.sampling_params import SamplingParams
from base.speculative import parse_speculative_config
from protos import worker_pb2
from protos.block_hash import hash_blocks
from scheduler.core import Scheduler
from scheduler.ngram_proposer import NgramProposer
from scheduler.sequence import Sequence
from scheduler.speculation_payoff import SpeculationPayoff
from tests.unit.scheduler.test_scheduler import BLOCK_SIZE, make_scheduler

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                    "disable_by_batch_size": 1024})


def next_token(tokens: list[int], num_prompt_tokens: int, copies: bool = True) -> int:
    """Copy the prompt over and over, except every 5th position gets a token of its own (every one if not copies)."""
    if len(tokens) % 5 == 0 or not copies:
        return 3 + sum((i + 1) * t for i, t in enumerate(tokens)) % 97
    return tokens[len(tokens) - num_prompt_tokens]


@dataclass
class CopyingWorker:
    """Holds each sequence's tokens and block table only from the steps' diffs, as the real worker does, and
    verifies proposals: keeps its own tokens up to the first that differs from the proposal."""
    seqs: dict[str, tuple[list[int], list[int], int]] = field(default_factory=dict)
    num_drafts: int = 0
    copies: bool = True
    seconds_per_step: tuple[float, float] = (0.0, 0.0)   # reported step time: fixed + per token * tokens

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        for seq_id in req.freed_seq_ids:
            del self.seqs[seq_id]
        scheduled = []
        for new in req.new_seqs:
            self.seqs[new.seq_id] = (list(new.token_ids), list(new.block_ids), new.num_prompt_tokens)
            scheduled.append((new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens, []))
        for cached in req.cached_seqs:
            blocks = self.seqs[cached.seq_id][1]
            blocks[:] = [*(() if cached.replaces_block_table else blocks), *cached.new_block_ids]
            scheduled.append((cached.seq_id, cached.num_computed_tokens, cached.num_scheduled_tokens,
                              list(cached.draft_token_ids)))
        fixed, per_token = self.seconds_per_step
        result = worker_pb2.StepResult(step_id=req.step_id,
                                       busy_seconds=fixed + per_token * sum(count for *_, count, _ in scheduled))
        for seq_id, start, count, drafts in scheduled:
            tokens, blocks, num_prompt_tokens = self.seqs[seq_id]
            assert start + count <= len(tokens) + len(drafts) and len(blocks) * BLOCK_SIZE >= start + count
            if start + count == len(tokens) + len(drafts):
                self.num_drafts += len(drafts)
                for draft in [*drafts, None]:
                    token = next_token(tokens, num_prompt_tokens, self.copies)
                    tokens.append(token)
                    result.sampled.add(seq_id=seq_id, token_id=token)
                    if token != draft:
                        break
        return result


def run(scheduler: Scheduler, worker: CopyingWorker, depth: int = 1) -> dict[str, list[int]]:
    """Step to the end with up to `depth` steps in flight (2: the scheduler service's async scheduling)."""
    in_flight: deque = deque()
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < depth and (step := scheduler.schedule()) is not None:
            in_flight.append((step, worker.step(step)))
        if not in_flight:
            continue
        for out in scheduler.update(*in_flight.popleft()):
            tokens.setdefault(f"{out.request_id}/{out.index}", []).extend(out.new_token_ids)
    return tokens


def add_requests(scheduler: Scheduler, count: int = 6, max_tokens: int = 40, n: int = 1) -> None:
    for i in range(count):
        prompt = [10 + (i * 7 + j * 3) % 50 for j in range(5 + 3 * i)]
        scheduler.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                              n=n, seed=1 if n > 1 else None))


def generate(depth: int = 1, n: int = 1, **overrides) -> tuple[dict[str, list[int]], Scheduler, CopyingWorker]:
    scheduler, worker = make_scheduler(**overrides), CopyingWorker()
    add_requests(scheduler, n=n)
    return run(scheduler, worker, depth), scheduler, worker


@pytest.mark.parametrize("depth", [1, 2])
def test_outputs_are_the_same_with_proposals_and_most_proposals_are_kept(depth):
    plain, _, _ = generate(depth)
    speculated, scheduler, worker = generate(depth, speculative_config=NGRAM)
    assert speculated == plain
    counters = scheduler.counters
    assert worker.num_drafts == counters.spec_proposed_tokens > 100
    assert 0.5 < counters.spec_accepted_tokens / counters.spec_proposed_tokens < 1   # some rejected, most kept
    assert counters.steps < 0.6 * generate(depth)[1].counters.steps
    by_position = counters.spec_accepted_by_position   # a token is kept only after all before it were
    assert len(by_position) == 4 and by_position == sorted(by_position, reverse=True) and by_position[0] > 0


def test_every_block_comes_back_and_only_kept_tokens_are_cached():
    tokens, scheduler, _ = generate(speculative_config=NGRAM)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    prompts = make_scheduler()
    add_requests(prompts)
    kept_hashes = set()
    for seq_id, output in tokens.items():
        prompt = prompts.requests[seq_id.split("/")[0]].prompt_token_ids
        kept_hashes.update(hash_blocks(prompt + output, BLOCK_SIZE, "", parent=bm.root_hash))
    assert bm.cached and set(bm.cached) <= kept_hashes


def test_a_tight_pool_preempts_and_gives_the_same_outputs():
    plain, _, _ = generate()
    speculated, scheduler, _ = generate(num_blocks=24, speculative_config=NGRAM)
    assert scheduler.counters.preemptions > 0 and scheduler.counters.spec_accepted_tokens > 0
    assert speculated == plain
    assert scheduler.block_manager.num_free_blocks == 24


def test_parallel_samples_speculate_each_on_its_own():
    plain, _, _ = generate(n=3)
    speculated, scheduler, _ = generate(n=3, speculative_config=NGRAM)
    assert speculated == plain and len(speculated) == 18
    assert scheduler.counters.spec_accepted_tokens > 0


def test_proposals_never_run_past_max_tokens():
    for max_tokens in (2, 3, 7):
        scheduler, worker = make_scheduler(speculative_config=NGRAM), CopyingWorker()
        add_requests(scheduler, max_tokens=max_tokens)
        speculated = run(scheduler, worker)
        assert all(len(out) == max_tokens for out in speculated.values())
        assert worker.num_drafts <= 6 * (max_tokens - 2) * 4


def test_an_abort_with_proposals_in_flight_frees_every_block():
    scheduler, worker = make_scheduler(speculative_config=NGRAM), CopyingWorker()
    add_requests(scheduler)
    for _ in range(8):
        scheduler.update(step := scheduler.schedule(), worker.step(step))
    step = scheduler.schedule()
    assert any(cached.draft_token_ids for cached in step.cached_seqs)
    for i in range(6):
        scheduler.abort_request(f"r{i}")
    assert scheduler.update(step, worker.step(step)) == []
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_no_proposals_once_the_batch_reaches_disable_by_batch_size():
    config = json.dumps({**json.loads(NGRAM), "disable_by_batch_size": 6})
    _, scheduler, worker = generate(speculative_config=config)
    assert worker.num_drafts > 0   # once requests finish, the batch falls under 6
    _, scheduler, worker = generate(speculative_config=json.dumps({**json.loads(NGRAM), "disable_by_batch_size": 1}))
    assert worker.num_drafts == 0


def test_the_latest_occurrence_of_the_longest_suffix_is_proposed():
    proposer = NgramProposer(parse_speculative_config(NGRAM))
    seq = Sequence("s/0", "s", 0, [1, 2, 3, 9, 2, 3, 7, 8, 5, 2, 3], 11, SamplingParams(), 0)
    assert proposer.propose(seq, 4) == [7, 8, 5, 2]          # "2 3" last seen before 7 (3-gram "5 2 3" is new)
    seq.token_ids += [4]
    assert proposer.propose(seq, 4) == []                     # 4 never seen before
    assert NgramProposer(parse_speculative_config(NGRAM)).propose(
        Sequence("t/0", "t", 0, [256, 1, 0, 0, 1], 5, SamplingParams(), 0), 2) == [0, 0]   # token-aligned only


@pytest.mark.parametrize("text, error", [
    ('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"), ("[1]", "JSON object"),
    ('{"speculative_tokens": 3}', "unknown keys"), ("{", "not JSON"),
])
def test_a_bad_speculative_config_names_what_is_wrong(text, error):
    with pytest.raises(ValueError, match=error):
        parse_speculative_config(text)


def test_the_payoff_break_even_batch_grows_with_acceptance_and_fixed_cost():
    payoff = SpeculationPayoff()
    assert payoff.break_even_batch() == float("inf")   # nothing measured yet: speculate
    for i in range(64):
        tokens = 8 + i % 24
        payoff.observe_step(tokens, 0.02 + 0.0005 * tokens)   # fixed cost = 40 tokens' worth
        payoff.observe_verified(4, 2)                         # half kept
    assert payoff.break_even_batch() == pytest.approx(40.0)
    assert payoff.pays_at(39) and not payoff.pays_at(41)
    for _ in range(512):
        payoff.observe_verified(4, 3)
    assert payoff.break_even_batch() == pytest.approx(120.0)


@pytest.mark.parametrize("copies", [True, False])
def test_proposals_stop_where_the_measured_payoff_says_they_cost_more(copies):
    """6 sequences, steps of 10 ms + 1 ms a token: kept at 3 in 4, proposals pay (break-even 30 sequences); a
    model that never takes them stops being offered them once that is measured."""
    measured = json.dumps({**json.loads(NGRAM), "disable_by_batch_size": None})
    scheduler = make_scheduler(max_model_len=256, num_blocks=256, speculative_config=measured)
    worker = CopyingWorker(copies=copies, seconds_per_step=(0.01, 0.001))
    add_requests(scheduler, max_tokens=120)
    run(scheduler, worker)
    proposed = scheduler.counters.spec_proposed_tokens
    if copies:
        assert proposed > 500 and scheduler.speculation.payoff.break_even_batch() > 6
    else:
        assert 64 <= proposed < 200 and scheduler.speculation.payoff.break_even_batch() < 1
