"""The scheduler on its own, driven by a fake worker that keeps state from the step diffs like the real one."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from base.config import EngineConfig
from base.sampling_params import SamplingParams
from base.structured_output import StructuredOutput
from protos import worker_pb2
from protos.block_hash import hash_blocks
from scheduler.admission import AdmissionLimits, QueueFull
from scheduler.baselines import scheduler_for
from scheduler.core import RequestOutput, Scheduler

BLOCK_SIZE = 4
EOS = 2


@dataclass
class FakeWorker:
    """Holds each sequence's tokens and block table only from what the steps said; samples a token that depends
    on every known token, so a recomputed sequence must produce the same continuation."""
    seqs: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    steps: list[worker_pb2.StepRequest] = field(default_factory=list)
    asked_to_stop: set[int] = field(default_factory=set)   # step ids cut short between layers: nothing sampled

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        self.steps.append(req)
        for seq_id in req.freed_seq_ids:
            del self.seqs[seq_id]
        scheduled = []
        for new in req.new_seqs:
            self.seqs[new.seq_id] = (list(new.token_ids), list(new.block_ids))
            scheduled.append((new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens))
        for cached in req.cached_seqs:
            blocks = self.seqs[cached.seq_id][1]
            blocks[:] = [*(() if cached.replaces_block_table else blocks), *cached.new_block_ids]
            scheduled.append((cached.seq_id, cached.num_computed_tokens, cached.num_scheduled_tokens))
        result = worker_pb2.StepResult(step_id=req.step_id, interrupted=req.step_id in self.asked_to_stop)
        for seq_id, start, count in scheduled if not result.interrupted else ():
            tokens, blocks = self.seqs[seq_id]
            assert start + count <= len(tokens) and len(blocks) * BLOCK_SIZE >= start + count
            if start + count == len(tokens):
                token = 3 + sum((i + 1) * t for i, t in enumerate(tokens)) % 97
                tokens.append(token)
                result.sampled.add(seq_id=seq_id, token_id=token)
        return result


def make_scheduler(num_blocks: int = 64, max_model_len: int = 128, **overrides) -> Scheduler:
    config = EngineConfig(block_size=BLOCK_SIZE, **overrides)
    model = worker_pb2.ModelInfo(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                                 eos_token_ids=[EOS], model_name="tiny")
    return scheduler_for(config, model)


def test_the_budget_at_auto_is_the_one_the_worker_names_else_a_gpus():
    assert make_scheduler().config.max_num_batched_tokens == 2048   # a worker that names none
    model = worker_pb2.ModelInfo(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=128, eos_token_ids=[EOS],
                                 model_name="tiny", max_num_batched_tokens=1024)
    assert scheduler_for(EngineConfig(block_size=BLOCK_SIZE), model).config.max_num_batched_tokens == 1024
    assert scheduler_for(EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=8),
                         model).config.max_num_batched_tokens == 8


def run_step(scheduler: Scheduler, worker: FakeWorker) -> list[RequestOutput]:
    step = scheduler.schedule()
    return scheduler.update(step, worker.step(step)) if step is not None else []


def run_to_end(scheduler: Scheduler, worker: FakeWorker, outputs: list[RequestOutput] | None = None
               ) -> dict[str, list[int]]:
    outputs = outputs or []
    while scheduler.has_unfinished_requests():
        outputs += run_step(scheduler, worker)
    tokens: dict[str, list[int]] = {}
    for out in outputs:
        tokens.setdefault(f"{out.request_id}/{out.index}", []).extend(out.new_token_ids)
    return tokens


def scheduled_tokens(step: worker_pb2.StepRequest) -> dict[str, int]:
    return {s.seq_id: s.num_scheduled_tokens for s in [*step.new_seqs, *step.cached_seqs]}


def params(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=kwargs.pop("ignore_eos", True), **kwargs)


def test_a_long_prompt_is_chunked_under_the_token_budget_and_samples_only_at_its_end():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker()
    scheduler.add_request("long", list(range(3, 23)), params(2))
    outputs = [run_step(scheduler, worker) for _ in range(3)]
    assert [scheduled_tokens(s) for s in worker.steps] == [{"long/0": 8}, {"long/0": 8}, {"long/0": 4}]
    assert [len(o) for o in outputs] == [0, 0, 1]
    assert scheduler.counters.chunked_prefills == 2


def test_running_decodes_keep_going_while_a_long_prompt_is_chunked_in_the_rest_of_the_budget():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker()
    scheduler.add_request("short", [5, 6, 7], params(8))
    run_step(scheduler, worker)
    scheduler.add_request("long", list(range(3, 43)), params(2))
    for _ in range(4):
        run_step(scheduler, worker)
        assert scheduled_tokens(worker.steps[-1]) == {"short/0": 1, "long/0": 7}
    assert scheduler.requests["long"].seqs[0].num_output_tokens == 0


def test_admission_is_first_come_first_served_under_max_num_seqs():
    scheduler, worker = make_scheduler(max_num_seqs=2), FakeWorker()
    for name in "abc":
        scheduler.add_request(name, [5, 6, 7], params(3))
    run_step(scheduler, worker)
    assert set(scheduled_tokens(worker.steps[0])) == {"a/0", "b/0"}
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    run_to_end(scheduler, worker)
    assert scheduler.block_manager.num_free_blocks == 64


def test_requests_waiting_for_their_grammar_count_against_the_queue_bound():
    scheduler, limits = make_scheduler(max_num_seqs=1), AdmissionLimits(max_queued_requests=2)
    constrained = SamplingParams(max_tokens=3, structured_output=StructuredOutput("regex", "[ab]+"))
    for name in "abc":   # one free seat and two places in the queue
        limits.check(scheduler, 4)
        scheduler.add_request(name, [5, 6, 7, 8], constrained)
    assert [s.request_id for s in scheduler.compiling] == ["a", "b", "c"] and not scheduler.waiting
    with pytest.raises(QueueFull, match="3 requests waiting"):   # the service answers RESOURCE_EXHAUSTED
        limits.check(scheduler, 4)
    with pytest.raises(QueueFull, match="12 prompt tokens waiting"):
        AdmissionLimits(max_queued_tokens=12).check(scheduler, 4)


def test_n_samples_count_as_n_against_max_num_seqs():
    scheduler, worker = make_scheduler(max_num_seqs=3), FakeWorker()
    scheduler.add_request("pair", [5, 6, 7], params(3, n=2, temperature=1.0, seed=1))
    scheduler.add_request("second", [8, 9], params(3))
    scheduler.add_request("third", [8, 9, 10], params(3))
    run_step(scheduler, worker)
    assert set(scheduled_tokens(worker.steps[0])) == {"pair/0", "second/0"}
    run_step(scheduler, worker)                          # the sibling is forked: three running, "third" waits
    assert len(scheduler.running) == 3 and [s.request_id for s in scheduler.waiting] == ["third"]
    with pytest.raises(ValueError, match="n"):
        scheduler.add_request("too-many", [5], params(2, n=4))


def test_parallel_samples_share_the_prompt_blocks_and_copy_on_write_the_partial_one():
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request("r", list(range(3, 13)), params(4, n=3, temperature=1.0))   # 10 tokens: 2 full + 2
    run_step(scheduler, worker)
    first, second, third = scheduler.requests["r"].seqs
    assert first.block_ids[:2] == second.block_ids[:2] == third.block_ids[:2]
    assert scheduler.block_manager.blocks[first.block_ids[0]].ref_count == 3
    run_step(scheduler, worker)                          # samples 1, 2 recompute the last prompt token, unstored
    run_step(scheduler, worker)                          # everyone has written into the partial block
    copies = [(c.src, c.dst) for step in worker.steps[1:3] for c in step.block_copies]
    assert len(copies) == 2                              # the last writer keeps the original partial block
    tails = {first.block_ids[2], second.block_ids[2], third.block_ids[2]}
    assert len(tails) == 3
    assert 64 - scheduler.block_manager.num_free_blocks == 2 + 3
    run_to_end(scheduler, worker)
    assert scheduler.block_manager.num_free_blocks == 64


def test_preemption_takes_the_newest_puts_it_first_in_line_and_it_finishes_with_the_same_tokens():
    prompts = {f"r{i}": [3 + i] * (5 + i) for i in range(4)}
    roomy, worker = make_scheduler(), FakeWorker()
    for rid, prompt in prompts.items():
        roomy.add_request(rid, prompt, params(14))
    expected = run_to_end(roomy, worker)
    assert roomy.counters.preemptions == 0

    scheduler, worker = make_scheduler(num_blocks=14), FakeWorker()
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, params(14))
    outputs = []
    while scheduler.counters.preemptions == 0:
        outputs += run_step(scheduler, worker)
    assert scheduler.waiting[0].request_id == "r3"       # the newest yields, back to the front of the queue
    assert scheduler.waiting[0].block_ids == []
    assert "r3/0" in worker.steps[-1].freed_seq_ids      # the worker drops it in the same step
    tokens = run_to_end(scheduler, worker, outputs)
    resent = [s for step in worker.steps for s in step.new_seqs if s.seq_id == "r3/0"]
    assert len(resent) >= 2 and len(resent[-1].token_ids) > len(prompts["r3"])   # with what it had generated
    assert tokens == expected
    assert scheduler.block_manager.num_free_blocks == 14


def test_static_batching_admits_a_cohort_only_when_nothing_runs():
    scheduler, worker = make_scheduler(batching="static", max_num_seqs=2), FakeWorker()
    scheduler.add_request("a", [5, 6, 7], params(2))
    scheduler.add_request("b", [5, 6, 8], params(6))
    run_step(scheduler, worker)
    scheduler.add_request("c", [9, 9], params(2))
    for _ in range(4):                                   # "a" ends after 2 tokens, "c" still may not join
        run_step(scheduler, worker)
        assert "c/0" not in scheduled_tokens(worker.steps[-1])
    assert [s.request_id for s in scheduler.running] == ["b"]
    run_step(scheduler, worker)                          # "b" produces its last token
    run_step(scheduler, worker)
    assert set(scheduled_tokens(worker.steps[-1])) == {"c/0"}


def test_static_cohort_forms_across_a_small_token_budget():
    scheduler, worker = make_scheduler(batching="static", max_num_seqs=3, max_num_batched_tokens=4), FakeWorker()
    for name in "abcd":
        scheduler.add_request(name, [5, 6, 7], params(4))
    run_step(scheduler, worker)
    assert [s.request_id for s in scheduler.running] == ["a", "b", "c"]
    assert [s.request_id for s in scheduler.waiting] == ["d"]
    run_to_end(scheduler, worker)


def test_contiguous_layout_reserves_max_model_len_per_sequence():
    scheduler, worker = make_scheduler(num_blocks=40, max_model_len=64, kv_layout="contiguous"), FakeWorker()
    for name in "abc":
        scheduler.add_request(name, [5, 6, 7], params(4))
    run_step(scheduler, worker)
    assert len(scheduler.running) == 2                   # 16 blocks each: a third does not fit in 40
    assert all(len(s.block_ids) == 16 for s in scheduler.running)
    run_to_end(scheduler, worker)
    assert scheduler.block_manager.num_free_blocks == 40
    paged = make_scheduler(num_blocks=40, max_model_len=64)
    for name in "abc":
        paged.add_request(name, [5, 6, 7], params(4))
    run_step(paged, FakeWorker())
    assert all(len(s.block_ids) == 1 for s in paged.running)


def test_finish_rules_eos_stop_token_and_max_tokens():
    scheduler = make_scheduler()
    for name, p in {"eos": params(8, ignore_eos=False), "ignored": params(2), "stop": params(8, stop_token_ids=(50,)),
                    "plain": params(8, ignore_eos=False)}.items():
        scheduler.add_request(name, [5, 6, 7, 8], p)
    step = scheduler.schedule()
    result = worker_pb2.StepResult()
    for seq_id, token in {"eos/0": EOS, "ignored/0": EOS, "stop/0": 50, "plain/0": 9}.items():
        result.sampled.add(seq_id=seq_id, token_id=token)
    outputs = {o.request_id: o for o in scheduler.update(step, result)}
    assert (outputs["eos"].finish_reason, outputs["eos"].stop_token_id) == ("stop", None)
    assert (outputs["stop"].finish_reason, outputs["stop"].stop_token_id) == ("stop", 50)
    assert outputs["ignored"].finish_reason is None and outputs["plain"].finish_reason is None
    step = scheduler.schedule()
    assert set(step.freed_seq_ids) == {"eos/0", "stop/0"}
    result = worker_pb2.StepResult()
    result.sampled.add(seq_id="ignored/0", token_id=4)
    result.sampled.add(seq_id="plain/0", token_id=4)
    outputs = {o.request_id: o for o in scheduler.update(step, result)}
    assert outputs["ignored"].finish_reason == "length" and outputs["plain"].finish_reason is None


def test_abort_between_schedule_and_update_drops_the_result_and_frees_at_once():
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request("a", list(range(3, 20)), params(4))
    scheduler.add_request("b", [5, 6], params(2))
    step = scheduler.schedule()
    assert scheduler.abort_request("a") and not scheduler.abort_request("a")
    outputs = scheduler.update(step, worker.step(step))
    assert [o.request_id for o in outputs] == ["b"]
    step = scheduler.schedule()
    assert "a/0" in step.freed_seq_ids
    run_to_end(scheduler, worker, scheduler.update(step, worker.step(step)))
    assert scheduler.block_manager.num_free_blocks == 64 and not scheduler.has_unfinished_requests()


def interrupted_run(interrupt: bool) -> tuple[Scheduler, FakeWorker, dict, dict]:
    """A decode beside a long prompt's chunks, its second step cut short if asked; the scheduler and worker after
    that step, the sequences' (computed, pending) before and after it, and every request's tokens at the end."""
    scheduler, worker = make_scheduler(max_num_batched_tokens=9, enable_prefix_caching=True), FakeWorker()
    scheduler.add_request("short", [5, 6, 7], params(6))
    scheduler.add_request("long", list(range(10, 34)), params(4))
    outputs = run_step(scheduler, worker)
    state = lambda: {s.seq_id: (s.num_computed_tokens, s.num_pending_tokens) for s in scheduler.running}  # noqa: E731
    before = state()
    step = scheduler.schedule()
    if interrupt:
        assert scheduler.interruptible(step.step_id) is not None
        worker.asked_to_stop.add(step.step_id)
    cached_blocks = set(scheduler.block_manager.cached)
    outputs += scheduler.update(step, worker.step(step))
    assert len(outputs) == 1 + (not interrupt)   # the short prompt's first token; its second unless cut short
    assert (set(scheduler.block_manager.cached) == cached_blocks) == interrupt   # a chunk's full blocks registered
    return scheduler, worker, {"before": before, "after": state(), "step": scheduled_tokens(step)}, \
        run_to_end(scheduler, worker, outputs)


def test_an_interrupted_step_leaves_its_sequences_as_it_found_them_and_is_computed_again():
    """The worker stopped the step between two layers (gpu_worker/interrupts.py): nothing of it is kept, the next
    step computes the same positions again, and every request ends with the tokens of a run never interrupted."""
    scheduler, worker, seen, tokens = interrupted_run(interrupt=True)
    assert seen["after"] == seen["before"]
    assert scheduled_tokens(worker.steps[2]) == seen["step"]   # the same positions, sent again
    assert [s.num_computed_tokens for s in worker.steps[2].cached_seqs] == \
        [s.num_computed_tokens for s in worker.steps[1].cached_seqs]
    assert scheduler.stats().num_interrupted_steps == 1
    assert tokens == interrupted_run(interrupt=False)[3]


def test_only_the_single_step_in_flight_may_be_interrupted():
    """With async scheduling the next step is built on the running one's tokens: neither may be cut short."""
    scheduler = make_scheduler()
    scheduler.add_request("a", [5, 6, 7], params(6))
    first = scheduler.schedule()
    assert [s.seq_id for s in scheduler.interruptible(first.step_id)] == ["a/0"]
    second = scheduler.schedule()
    assert scheduler.interruptible(first.step_id) is None and scheduler.interruptible(second.step_id) is None


def test_bad_requests_are_rejected_before_anything_is_allocated():
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    cases = {"prompt": ([], params(2)), "max_tokens": ([5] * 60, params(8)), "never fit": ([5] * 20, params(2))}
    for message, (prompt, p) in cases.items():
        with pytest.raises(ValueError, match=message):
            scheduler.add_request("x", prompt, p)
    scheduler.add_request("x", [5], params(2))
    with pytest.raises(ValueError, match="request_id"):
        scheduler.add_request("x", [5], params(2))
    assert scheduler.block_manager.num_free_blocks == 4 and len(scheduler.waiting) == 1


def test_stats_report_queues_blocks_and_counters():
    scheduler, worker = make_scheduler(max_num_seqs=1), FakeWorker()
    scheduler.add_request("a", list(range(3, 13)), params(3))
    scheduler.add_request("b", list(range(3, 13)), params(3))
    run_step(scheduler, worker)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks, stats.block_size) == (1, 1, 64, BLOCK_SIZE)
    # b's prompt is a's: all but its last block's 2 tokens are in the prefix cache, so 2 are left to prefill
    assert stats.num_free_blocks == 61 and stats.waiting_tokens == 2 and stats.running_tokens == 11
    assert stats.prompt_tokens_total == 10 and stats.generation_tokens_total == 1 and stats.num_steps == 1
    run_to_end(scheduler, worker)
    stats = scheduler.stats()
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 20
    assert stats.num_cached_free_blocks == 3 and stats.num_free_blocks == 64
    stored, removed = scheduler.drain_kv_events()
    assert len(stored) == 3 and removed == [] and scheduler.drain_kv_events() == ([], [])


def test_a_queued_prompt_is_published_at_admission_and_withdrawn_if_aborted_before_it_ran():
    """With several router replicas, a prompt queued here must be in the prefix index before it is computed; one
    that leaves without running must not stay there."""
    scheduler, worker = make_scheduler(max_num_seqs=1, announce_prompts=True), FakeWorker()
    first, queued = list(range(3, 13)), list(range(30, 40))       # two full blocks each
    scheduler.add_request("a", first, params(3))
    scheduler.add_request("b", queued, params(3))                 # waits: one seat
    first_blocks, queued_blocks = (hash_blocks(p, BLOCK_SIZE, "tiny") for p in (first, queued))
    assert scheduler.drain_kv_events() == (first_blocks + queued_blocks, [])
    run_step(scheduler, worker)                                   # a computed: cached now, nothing changes
    assert scheduler.drain_kv_events() == ([], []) and len(scheduler.waiting) == 1
    scheduler.abort_request("b")
    assert scheduler.drain_kv_events() == ([], queued_blocks)
    run_to_end(scheduler, worker)                                 # a's answer fills a third block
    stored, removed = scheduler.drain_kv_events()
    assert len(stored) == 1 and removed == [] and set(first_blocks) <= set(scheduler.block_manager.cached)


@pytest.mark.parametrize("switches", [dict(), dict(announce_prompts=True, enable_prefix_caching=False)])
def test_a_prompt_is_announced_only_when_asked_and_prefix_caching_is_on(switches):
    scheduler = make_scheduler(**switches)
    scheduler.add_request("a", list(range(3, 13)), params(3))
    assert scheduler.drain_kv_events() == ([], []) and not scheduler.block_manager.announced


def test_queued_prefill_counts_a_prompt_shared_by_the_queue_once():
    scheduler = make_scheduler(max_num_seqs=1)
    system = list(range(3, 3 + 4 * BLOCK_SIZE))                  # four full blocks, nothing cached yet
    for i in range(3):
        scheduler.add_request(f"r{i}", system + [100 + i, 200 + i], params(2))
    # the first computes the shared blocks; the two behind it prefill only their own two tokens
    assert scheduler.stats().waiting_tokens == (4 * BLOCK_SIZE + 2) + 2 + 2
    other = list(range(50, 50 + 4 * BLOCK_SIZE))
    scheduler.add_request("cold", other + [7], params(2))
    assert scheduler.stats().waiting_tokens == (4 * BLOCK_SIZE + 2) + 2 + 2 + (4 * BLOCK_SIZE + 1)


def test_a_request_held_for_its_pull_keeps_its_place_in_the_queue():
    """fcfs: what arrived while a request's prefix was pulled waits behind it; what arrived before it, ahead."""
    scheduler, worker = make_scheduler(max_num_seqs=1), FakeWorker()
    scheduler.add_request("running", [5, 6, 7], params(3))
    run_step(scheduler, worker)
    scheduler.add_request("before", [5, 6, 8], params(3))
    scheduler.add_request("pulled", [5, 6, 9], params(3), held=True)
    scheduler.add_request("during", [5, 6, 10], params(3))
    assert [s.request_id for s in scheduler.waiting] == ["before", "during"]
    scheduler.release_held("pulled")
    assert [s.request_id for s in scheduler.waiting] == ["before", "pulled", "during"]
    run_to_end(scheduler, worker)
    admitted = [new.seq_id for step in worker.steps for new in step.new_seqs]
    assert admitted == ["running/0", "before/0", "pulled/0", "during/0"]


def test_a_released_request_does_not_pass_a_preempted_one_at_the_front():
    scheduler = make_scheduler()
    scheduler.add_request("pulled", [5, 6, 9], params(3), held=True)
    scheduler.add_request("later", [5, 6, 10], params(3))
    preempted = scheduler.waiting.popleft()
    preempted.num_preemptions = 1
    scheduler.waiting.appendleft(preempted)   # as Scheduler.preempt leaves one
    scheduler.release_held("pulled")
    assert [s.request_id for s in scheduler.waiting] == ["later", "pulled"]
