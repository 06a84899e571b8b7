"""The continuous-batching scheduler: one token budget per step, shared by decodes and prefill chunks.

Each step the running decodes get their next token first; the rest of the budget goes to unfinished prefills (their
next chunk) and waiting sequences, in the order of --scheduling-policy (scheduler/scheduling_policy.py; fcfs: the
running prefills, then the queue in arrival order), while the budget, max_num_seqs and the KV pool allow (under
priority and fair a newcomer that outranks the running work gets a step without it: sit_out). When the
pool runs dry, the running sequence the policy ranks last (fcfs: the newest) is preempted: it yields every block
and goes back to the queue, to be recomputed later.

A step's bookkeeping is done when it is built: its tokens count as computed, and each sequence it samples for
holds a pending token, whose position the next step may already compute (the worker knows the token by then).
So the next step can be scheduled while this one runs (--async-scheduling); update() then fills in the sampled
tokens, in step order, and ends the sequences they finish: a sequence that finished in step N costs at most one
step of compute more, and its token from that step is never emitted.

With speculative decoding (--speculative-config), a decode may carry proposed tokens after its last one: they are
scheduled tokens like any other (budget, blocks), the worker keeps those its model would have sampled, and update()
rolls the sequence back to what was kept (rejected positions' blocks given back, never hashed). Such a sequence
waits for its result instead of running ahead: how many tokens it gains is not known before.
"""
from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from base.config import EngineConfig, step_tokens
from base.sampling_params import SamplingParams
from protos import common_pb2, scheduler_pb2, worker_pb2
from protos.block_hash import root_hash
from scheduler.block_manager import BlockManager
from scheduler.grammar_drafts import checked_proposals
from scheduler.grammar_masks import StructuredOutputManager, thinking_end
from scheduler.lora_adapters import LoraAdapters
from scheduler.request_checks import check_new_request, check_resumed
from scheduler.request_output import RequestOutput
from scheduler.scheduling_policy import scheduling_policy
from scheduler.sequence import DEFAULT_TENANCY, Request, Sequence, SequenceStatus, Tenancy
from scheduler.speculation import Speculation
from scheduler.stats import StepCounters, stats_response
from scheduler.stopping import finish_reason


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: num_tokens from position start on; samples: it ends at the last token (or at
its last proposed one: num_drafts of its tokens are proposals)."""
    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    num_drafts: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, model: worker_pb2.ModelInfo,
                 new_block_manager: Callable[..., BlockManager] = BlockManager):
        # auto (0): the budget the worker sized itself for on its device (a worker that names none: a GPU's)
        self.config = config = replace(config, max_num_batched_tokens=step_tokens(
            config.max_num_batched_tokens or model.max_num_batched_tokens, "cuda"))
        self.block_size = model.block_size
        self.max_model_len = model.max_model_len
        self.eos_token_ids = frozenset(model.eos_token_ids)
        self.block_manager = new_block_manager(model.num_blocks, model.block_size,
                                               root_hash(model.model_name, config.hash_seed),
                                               enable_prefix_caching=config.enable_prefix_caching,
                                               announce_prompts=config.announce_prompts,
                                               sliding_window=model.sliding_window)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.worker_seqs: set[str] = set()
        self.freed_seq_ids: list[str] = []
        self.arrivals = itertools.count()
        self.counters = StepCounters()
        self.scheduled: dict[str, tuple[Sequence, int]] = {}   # the step being scheduled
        self.in_flight: dict[int, list[ScheduledChunk]] = {}     # built steps whose results are not in, by id
        self.budget = 0                           # tokens left to hand out in the step being scheduled
        self.vocab_size = model.vocab_size
        self.structured = StructuredOutputManager(model.model_path, model.vocab_size, list(model.eos_token_ids),
                                                  config.structured_output_compile_workers,
                                                  config.structured_output_compile_timeout)
        self.compiling: list[Sequence] = []      # waiting for their grammar: not in the queue yet
        self.held: dict[str, Sequence] = {}      # waiting for their prefix's KV from a peer (scheduler/kv_transfer.py)
        self.failed: list[RequestOutput] = []    # requests whose grammar failed, reported with the next update
        self.speculation = Speculation(config.speculative_config, model.max_model_len)
        self.drafts: dict[str, list[int]] = {}   # the step being scheduled: proposals by seq_id
        self.draft_masks: dict[str, list] = {}    # and the masks of the constrained ones' sampled positions
        self.lookahead = 0                        # the step being scheduled: KV slots reserved for a draft model
        self.speculating = False                  # and whether its decodes get proposals
        self.policy = scheduling_policy(config.scheduling_policy, config.priority_aging_steps,
                                        config.max_num_batched_tokens)
        self.num_seats = 0                        # the step being scheduled: batch slots taken
        self.lora = LoraAdapters(config.max_loras, config.enable_lora)
        self.model_name = model.model_name

    # --- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resumed_token_ids: list[int] = (), sampling: common_pb2.SamplingParams | None = None,
                    tenancy: Tenancy = DEFAULT_TENANCY, lora_name: str = "", held: bool = False) -> None:
        """resumed_token_ids: tokens a scheduler that died had generated for this request: it goes on after them
        as a preempted sequence would (they count towards max_tokens and penalties, and seeded sampling depends
        only on the position), so the continuation is the one that scheduler would have produced. sampling: the
        message params came from, if they came in one (kept for the worker, not built again). tenancy: its tenant
        and priority, for --scheduling-policy. lora_name: the adapter it runs with (AdapterNotFound where not
        loaded here). held: kept out of the queue until release_held (its prefix is being pulled; not with a
        grammar to compile, which holds it anyway)."""
        self.lora.check_known(lora_name)
        check_new_request(request_id, prompt_token_ids, params, self.requests, self.max_model_len, self.vocab_size,
                          self.config.max_num_seqs, self.config.max_num_batched_tokens, self.block_manager)
        check_resumed(resumed_token_ids, params)
        sampling = params.to_proto() if sampling is None else sampling
        request = Request(request_id, list(prompt_token_ids), params, sampling, tenancy, self.counters.steps,
                          lora_name)
        first = self.new_sequence(request, 0, [*prompt_token_ids, *resumed_token_ids])
        request.seqs.append(first)
        request.forked = params.n == 1
        self.requests[request_id] = request
        self.policy.on_arrival(tenancy)
        self.block_manager.announce(first)
        if params.structured_output is not None or params.bad_words:
            self.structured.submit(request_id, params.structured_output, params.bad_words,
                                   thinking_end(params.structured_output_after, prompt_token_ids))
            self.compiling.append(first)
        elif held:
            self.held[request_id] = first
        else:
            self.waiting.append(first)

    def release_held(self, request_id: str) -> None:
        """A held request joins the queue (its pull is over, whatever it brought), where its arrival puts it."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.queue_in_arrival_order(seq)

    def queue_in_arrival_order(self, seq: Sequence) -> None:
        """Behind every waiting sequence that arrived before it and any preempted one, ahead of those that came
        while it was held back (a pull, a grammar's compile): the wait does not cost it its place."""
        index = len(self.waiting)
        while index and self.waiting[index - 1].arrival > seq.arrival and not self.waiting[index - 1].num_preemptions:
            index -= 1
        self.waiting.insert(index, seq)

    def new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        salt = request.tenancy.cache_salt
        hash_root = (root_hash(self.model_name, self.config.hash_seed, request.lora_name, salt)
                     if request.lora_name or salt else None)
        return Sequence(f"{request.request_id}/{index}", request.request_id, index, token_ids,
                        len(request.prompt_token_ids), request.params, next(self.arrivals), request.tenancy,
                        request.arrival_step, lora_name=request.lora_name, hash_root=hash_root)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.policy.on_departure(request.tenancy)
        self.structured.free(request_id, [s.seq_id for s in request.seqs])
        for seq in request.seqs:
            if seq in self.compiling:
                self.compiling.remove(seq)
            elif self.held.get(request_id) is seq:
                del self.held[request_id]
            elif seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            if seq.status is not SequenceStatus.FINISHED:
                self.release(seq)
                seq.status = SequenceStatus.FINISHED
        self.retire_adapters()
        return True

    def unload_lora_adapter(self, name: str) -> None:
        """AdapterNotFound if not loaded; the requests using it go on (scheduler/lora_adapters.py)."""
        self.lora.unload(name, in_use=any(r.lora_name == name for r in self.requests.values()))

    def retire_adapters(self) -> None:
        if self.lora.retiring:
            self.lora.retire({r.lora_name for r in self.requests.values()})

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- scheduling ----------------------------------------------------------------------------------
    def schedule(self) -> worker_pb2.StepRequest | None:
        self.scheduled, self.drafts, self.draft_masks = {}, {}, {}
        self.budget = self.config.max_num_batched_tokens
        self.speculating = self.speculation.active(len(self.running))   # decided once a step
        # slots past a sampling sequence's tokens for a draft model's proposals, if it proposes after this step
        self.lookahead = self.speculation.lookahead if self.speculating else 0
        if self.compiling:
            self.queue_compiled()
        if self.structured.rows:
            self.check_grammars()
        # decodes first, then unfinished prefill chunks and admissions in the policy's order: a long prompt never
        # stalls the running decodes
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        preempted = not all([self.schedule_running(seq) for seq in decodes])
        self.begin_admission()
        admitting, queued = True, set(self.waiting)
        adapters = {s.lora_name for s in self.running if s.lora_name}
        leader = None   # the first sequence given prompt tokens: those it may preempt get none in this step
        for seq in self.policy.order(prefills, list(self.waiting), self.counters.steps):
            if leader is not None and self.policy.may_preempt_for(leader, seq, self.counters.steps):
                continue
            if seq.status is SequenceStatus.RUNNING:
                preempted |= not self.schedule_running(seq)
            elif admitting and not preempted and seq in queued:   # not one preempted in this step
                if not self.lora.may_join(seq.lora_name, adapters):
                    # its adapter waits for a slot; those behind it may go, unless it has waited too long
                    admitting = not self.lora.waited_too_long(seq.seq_id, self.counters.steps)
                    continue
                admitting = self.admit(seq)
                if seq.lora_name and seq.status is SequenceStatus.RUNNING:
                    adapters.add(seq.lora_name)
                    self.lora.stop_waiting(seq.seq_id)
            if leader is None and seq.seq_id in self.scheduled:
                leader = seq
        if leader in queued:
            self.sit_out(leader, decodes)
        return self.build_step()

    def sit_out(self, newcomer: Sequence, decodes: list[Sequence]) -> None:
        """The decodes that newcomer, admitted in this step, may preempt sit the step out: it is then newcomer's
        prompt and the decodes it does not outrank, the shortest wait for its first token; they run the next one."""
        for seq in decodes:
            if seq.seq_id in self.scheduled and self.policy.may_preempt_for(newcomer, seq, self.counters.steps):
                _, num_tokens = self.scheduled.pop(seq.seq_id)
                self.budget += num_tokens
                self.drafts.pop(seq.seq_id, None)
                self.draft_masks.pop(seq.seq_id, None)

    def schedule_running(self, seq: Sequence) -> bool:
        """Give seq its next tokens if the budget and the pool allow; False if making room preempted seq itself."""
        if self.budget == 0 or seq.status is not SequenceStatus.RUNNING:   # preempted for an older one
            return True
        if seq.num_pending_tokens and not self.may_run_ahead(seq):
            return True
        num_tokens = min(seq.num_tokens - seq.num_computed_tokens, self.budget)
        if seq.num_computed_tokens + num_tokens == seq.num_tokens and not self.structured.mask_ready(seq.seq_id):
            return True   # its grammar's mask for the token it would sample is still being filled
        samples = seq.num_computed_tokens + num_tokens == seq.num_tokens
        num_tokens += self.speculate(seq, num_tokens)
        if not self.make_room(seq, num_tokens + self.lookahead * samples):
            return False
        self.scheduled[seq.seq_id] = (seq, num_tokens)
        self.budget -= num_tokens
        return True

    def may_run_ahead(self, seq: Sequence) -> bool:
        """Whether seq, whose last token a step in flight is still sampling, may compute that token's position now:
        not when that token is its last (its length is reached), nor under a grammar, whose mask for the next token
        needs the pending one."""
        if seq.num_output_tokens + seq.num_pending_tokens >= seq.params.max_tokens:
            return False
        if seq.num_pending_tokens > 1 or self.speculating:
            return False   # proposals in flight, or to be made once its pending token is known
        return seq.num_tokens < self.max_model_len and not self.structured.constrains(seq.seq_id)

    # --- speculative decoding ------------------------------------------------------------------------
    def speculate(self, seq: Sequence, num_tokens: int) -> int:
        """Propose tokens after seq's last one, if it decodes now and the pool holds them without preempting
        anyone; how many it got."""
        if num_tokens != 1 or seq.num_pending_tokens or seq.seq_id not in self.worker_seqs or not self.speculating:
            return 0
        drafts = self.speculation.propose(seq, self.budget)
        if drafts and self.structured.constrains(seq.seq_id):
            drafts, self.draft_masks[seq.seq_id] = checked_proposals(self.structured, seq.seq_id, drafts)
        self.block_manager.free_blocks_before_window(seq)
        if not drafts or not self.block_manager.append_slots(seq, 1 + len(drafts) + self.lookahead):
            if seq.seq_id in self.draft_masks:
                self.draft_masks[seq.seq_id] = self.draft_masks[seq.seq_id][:1]   # its one sampled position's
            return 0
        self.drafts[seq.seq_id] = drafts
        return len(drafts)

    def settle(self, chunk: ScheduledChunk, num_accepted: int) -> None:
        """seq's verified proposals are in: it keeps num_accepted of them (and the token sampled after), the rest
        are rolled back; a sequence preempted meanwhile just knows its tokens."""
        self.counters.count_verified(chunk.num_drafts, num_accepted)
        self.speculation.payoff.observe_verified(chunk.num_drafts, num_accepted)
        seq = chunk.seq
        seq.num_pending_tokens = 0
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens = len(seq.token_ids) - 1
            self.block_manager.trim(seq, self.speculation.lookahead)

    def may_sample(self, seq: Sequence) -> bool:
        """Whether seq's next token may be sampled now: none is pending and its grammar's mask is filled."""
        return not seq.num_pending_tokens and self.structured.mask_ready(seq.seq_id)

    def queue_compiled(self) -> None:
        """Sequences whose grammar is ready join the queue once it has caught up with their output (resumed ones);
        those whose grammar failed end with the reason."""
        compiled, failed = self.structured.collect()
        for failure in failed:
            self.fail(failure.request_id, failure.reason, failure.overloaded)
        for seq in [s for s in self.compiling if s.request_id in compiled]:
            self.structured.add_sequence(seq.request_id, seq.seq_id, seq.output_token_ids)
        for seq in [s for s in self.compiling if self.structured.is_prepared(s.request_id, s.seq_id)]:
            self.compiling.remove(seq)
            self.queue_in_arrival_order(seq)

    def check_grammars(self) -> None:
        """Give the grammars' masks a moment (bounded) to be filled; end the requests whose grammar broke."""
        for seq_id, reason in self.structured.take_broken():
            self.fail(seq_id.rpartition("/")[0], reason)
        self.structured.wait_for_masks()

    def fail(self, request_id: str, reason: str, overloaded: bool = False) -> None:
        if self.abort_request(request_id):
            self.failed.append(RequestOutput(request_id, 0, [], finish_reason="abort", error=reason,
                                             overloaded=overloaded))

    def make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Free blocks for seq by preempting the running sequences the policy ranks last (fcfs: the newest); False
        if seq itself was preempted."""
        self.block_manager.free_blocks_before_window(seq)
        while not self.block_manager.append_slots(seq, num_tokens):
            victim = self.policy.victim(self.running, self.counters.steps)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def admit(self, seq: Sequence) -> bool:
        """Move waiting seq into the running batch with its first chunk, if seats, budget and pool allow (the
        policy may preempt a running sequence it ranks below seq); False if it must wait, and those after it too."""
        seats = self.seats(seq)
        if not self.may_join(seq) or not self.may_sample(seq) or not self.seat(seq, seats):
            return False
        while True:   # each preemption frees blocks: the prefix is matched again against what is left
            hits = self.block_manager.match_prefix(seq)
            num_tokens = min(seq.num_tokens - len(hits) * self.block_size, self.budget)
            samples = len(hits) * self.block_size + num_tokens == seq.num_tokens
            if self.block_manager.allocate(seq, hits, num_tokens + self.lookahead * samples):
                break
            if not self.preempt_for(seq):
                return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.num_charged_tokens = max(seq.num_charged_tokens, seq.num_computed_tokens)   # a cached prefix is free
        self.running.append(seq)
        self.num_seats += seats
        self.joined(seq)
        if seq.index == 0 and seq.num_preemptions == 0:
            self.requests[seq.request_id].num_cached_tokens = seq.num_computed_tokens
        if num_tokens:
            self.scheduled[seq.seq_id] = (seq, num_tokens)
        self.budget -= num_tokens
        return True

    def seat(self, seq: Sequence, seats: int) -> bool:
        """Whether the batch has seats for seq, after preempting for it what the policy allows."""
        while self.num_seats + seats > self.config.max_num_seqs:
            if not self.preempt_for(seq):
                return False
        return True

    def preempt_for(self, seq: Sequence) -> bool:
        """Preempt the running sequence the policy ranks last, if it ranks below waiting seq."""
        if not self.running:
            return False
        victim = self.policy.victim(self.running, self.counters.steps)
        if not self.policy.may_preempt_for(seq, victim, self.counters.steps):
            return False
        self.preempt(victim)
        return True

    # hooks of the static-batching baseline (scheduler/baselines.py)
    def begin_admission(self) -> None:
        self.num_seats = sum(self.seats(s) for s in self.running)

    def may_join(self, seq: Sequence) -> bool:
        return self.budget > 0

    def joined(self, seq: Sequence) -> None:
        pass

    def seats(self, seq: Sequence) -> int:
        """Batch slots seq holds: sample 0 of an n > 1 request keeps n until its siblings are forked."""
        return 1 if self.requests[seq.request_id].forked else seq.params.n

    def preempt(self, seq: Sequence) -> None:
        _, num_tokens = self.scheduled.pop(seq.seq_id, (seq, 0))
        self.budget += num_tokens
        self.running.remove(seq)
        self.release(seq)
        self.num_seats -= self.seats(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.lora.stop_waiting(seq.seq_id)
        seq.proposed_token_ids = []
        self.speculation.forget(seq.seq_id)
        if seq.seq_id in self.worker_seqs:
            self.worker_seqs.discard(seq.seq_id)
            self.freed_seq_ids.append(seq.seq_id)

    def build_step(self) -> worker_pb2.StepRequest | None:
        copies = self.block_manager.pending_copies
        if not self.scheduled and not self.freed_seq_ids and not copies and not self.failed and not self.lora.unloaded:
            return None
        self.counters.steps += 1
        step = worker_pb2.StepRequest(freed_seq_ids=self.freed_seq_ids, step_id=self.counters.steps,
                                      num_proposals=self.lookahead)
        step.block_copies.extend(worker_pb2.BlockCopy(src=s, dst=d) for s, d in copies)
        if self.lora.enabled:
            step.unloaded_lora_adapters.extend(self.lora.take_unloaded())
            step.lora_slots.extend(self.lora.place((s.lora_name for s in self.running), step.step_id))
        self.freed_seq_ids, self.block_manager.pending_copies = [], []
        step.token_bitmasks.extend(self.constrained_bitmasks())
        for seq, num_tokens in self.scheduled.values():
            if seq.seq_id in self.worker_seqs:
                replaced, seq.block_table_replaced = seq.block_table_replaced, False
                step.cached_seqs.add(seq_id=seq.seq_id, replaces_block_table=replaced,
                                     new_block_ids=seq.block_ids[0 if replaced else seq.num_blocks_sent:],
                                     num_computed_tokens=seq.num_computed_tokens, num_scheduled_tokens=num_tokens,
                                     draft_token_ids=self.drafts.get(seq.seq_id, ()))
            else:
                step.new_seqs.add(seq_id=seq.seq_id, token_ids=seq.token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                                  block_ids=seq.block_ids, num_computed_tokens=seq.num_computed_tokens,
                                  num_scheduled_tokens=num_tokens, sampling=self.requests[seq.request_id].sampling,
                                  sample_index=seq.index, kv_present_tokens=seq.kv_present_tokens,
                                  lora_name=seq.lora_name)
                self.worker_seqs.add(seq.seq_id)
            seq.num_blocks_sent = len(seq.block_ids)
        self.in_flight[step.step_id] = [self.computed(seq, num_tokens, len(self.drafts.get(seq.seq_id, ())))
                                         for seq, num_tokens in self.scheduled.values()]
        self.scheduled, self.drafts, self.draft_masks = {}, {}, {}
        return step

    def constrained_bitmasks(self) -> list[worker_pb2.TokenBitmask]:
        """The masks of the constrained sequences that sample in the step being built: one, or one per position
        where it verifies proposals (the grammar checked them: scheduler/grammar_drafts.py)."""
        sampling = [seq.seq_id for seq, n in self.scheduled.values() if self.structured.constrains(seq.seq_id)
                    and seq.num_computed_tokens + n - len(self.drafts.get(seq.seq_id, ())) == seq.num_tokens]
        entries = self.structured.bitmasks([seq_id for seq_id in sampling if seq_id not in self.draft_masks])
        for seq_id in sampling:
            if seq_id in self.draft_masks:
                self.structured.rows[seq_id].mask = None   # this token's: the next needs the tokens kept now
                entries.extend(worker_pb2.TokenBitmask(seq_id=seq_id, bits=mask.tobytes())
                               for mask in self.draft_masks[seq_id])
        return entries

    def computed(self, seq: Sequence, num_tokens: int, num_drafts: int) -> ScheduledChunk:
        """Count the step's tokens of seq as computed; if they reach its last token, the one sampled is pending
        (with proposals: every proposed position and the one after, until the step says how many it kept)."""
        chunk = ScheduledChunk(seq, seq.num_computed_tokens, num_tokens,
                               seq.num_computed_tokens + num_tokens - num_drafts == seq.num_tokens, num_drafts)
        seq.num_computed_tokens += num_tokens
        self.policy.charge(seq)
        seq.num_pending_tokens += chunk.samples + num_drafts
        return chunk

    def sampling_seq_ids(self, step_id: int) -> list[str]:
        """The sequences a built step samples a token for (what a worker returns one token each for)."""
        return [chunk.seq.seq_id for chunk in self.in_flight.get(step_id, []) if chunk.samples]

    # --- results -------------------------------------------------------------------------------------
    def update(self, step: worker_pb2.StepRequest, result: worker_pb2.StepResult) -> list[RequestOutput]:
        """A step's result, in the order the steps were built: its sampled tokens join their sequences."""
        chunks = self.in_flight.pop(step.step_id, [])
        if result.interrupted:
            self.take_back(chunks)
            outputs, self.failed = self.failed, []
            return outputs
        for chunk in chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:   # aborted or preempted while the step ran
                continue
            if chunk.start < seq.num_prompt_tokens:
                self.counters.prompt_tokens += min(chunk.num_tokens, seq.num_prompt_tokens - chunk.start)
                self.counters.chunked_prefills += not chunk.samples
            self.block_manager.register_full_blocks(seq)
        outputs = [self.append_tokens(list(entries))
                   for _, entries in itertools.groupby(result.sampled, key=lambda sampled: sampled.seq_id)]
        if self.speculation.config is not None:
            self.settle_speculation(chunks, result)
        outputs, self.failed = self.failed + outputs, []
        return [out for out in outputs if out is not None]

    def interruptible(self, step_id: int) -> list[Sequence] | None:
        """The sequences of built step step_id if the worker may cut it short (EngineLoop.interrupt_for): it is
        the only step in flight, so no later one counts on its tokens, and it consumed nothing a second build could
        not give again (proposals, grammar masks); None where it may not."""
        chunks = self.in_flight.get(step_id)
        if chunks is None or len(self.in_flight) != 1:
            return None
        if any(chunk.num_drafts or self.structured.constrains(chunk.seq.seq_id) for chunk in chunks):
            return None
        return [chunk.seq for chunk in chunks]

    def take_back(self, chunks: list[ScheduledChunk]) -> None:
        """The worker stopped the step between two layers: its sequences are where they were before it (their
        blocks kept, nothing registered in the prefix cache), for the next steps to compute those positions. Their
        tenants were charged for them already, and are not again when they are computed."""
        self.counters.interrupted_steps += 1
        for chunk in chunks:
            seq = chunk.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.num_pending_tokens -= chunk.samples + chunk.num_drafts
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens = chunk.start

    def settle_speculation(self, chunks: list[ScheduledChunk], result: worker_pb2.StepResult) -> None:
        """Take the step's proposals and verified counts, and time it for the payoff (speculation on only)."""
        self.take_proposals(result.proposals)
        if chunks and all(chunk.num_tokens - chunk.num_drafts == 1 for chunk in chunks):
            self.speculation.payoff.observe_step(sum(chunk.num_tokens for chunk in chunks), result.busy_seconds)
        if any(chunk.num_drafts for chunk in chunks):
            gained = Counter(sampled.seq_id for sampled in result.sampled)
            for chunk in chunks:
                if chunk.num_drafts:
                    self.settle(chunk, max(0, gained[chunk.seq.seq_id] - 1))

    def take_proposals(self, proposals) -> None:
        """A draft model's proposals, for the next step of the sequences still running (they follow the tokens
        this step gave them)."""
        for proposal in proposals:
            seq = self.sequence(proposal.seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.proposed_token_ids = list(proposal.token_ids)

    def append_tokens(self, entries: list[worker_pb2.SampledToken]) -> RequestOutput | None:
        """A sequence's tokens from one step (several where it verified proposals) as one output, up to the first
        that finishes it."""
        output = None
        for sampled in entries:
            new = self.append_token(sampled)
            if new is None:
                break
            if output is None:
                output = new
            else:
                output.new_token_ids += new.new_token_ids
                output.new_logprobs += new.new_logprobs
                output.finish_reason, output.stop_token_id = new.finish_reason, new.stop_token_id
            if new.finish_reason:
                break
        if output is not None and not output.finish_reason and self.structured.constrains(entries[0].seq_id):
            self.structured.accept(entries[0].seq_id, output.new_token_ids)   # all of them in one task
        return output

    def append_token(self, sampled: worker_pb2.SampledToken) -> RequestOutput | None:
        """The pending token of a running sequence, or of one preempted after its step was built (its recompute
        will include it); a finished one's is dropped."""
        seq = self.sequence(sampled.seq_id)
        if seq is None or seq.status is SequenceStatus.FINISHED or not seq.num_pending_tokens:
            return None
        request = self.requests[seq.request_id]
        seq.token_ids.append(sampled.token_id)
        seq.proposed_token_ids = []   # proposed after the tokens before this one
        seq.num_pending_tokens -= 1
        self.counters.generation_tokens += 1
        output = RequestOutput(seq.request_id, seq.index, [sampled.token_id],
                               num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens)
        if sampled.HasField("logprob"):
            output.new_logprobs.append(sampled.logprob)
        if seq.params.prompt_logprobs is not None and seq.index == 0 and seq.num_output_tokens == 1:
            output.prompt_logprobs = list(sampled.prompt_logprobs)
        if sampled.embedding:
            output.embedding = list(sampled.embedding)
        if not request.forked and seq.status is SequenceStatus.RUNNING:   # a preempted one forks once back
            self.fork(request, seq)
        grammar_done = self.structured.is_terminated(seq.seq_id, sampled.token_id)
        output.finish_reason, output.stop_token_id = finish_reason(seq, sampled.token_id, self.eos_token_ids,
                                                                   self.max_model_len, grammar_done)
        if output.finish_reason:
            self.finish(seq)
        return output

    def fork(self, request: Request, first: Sequence) -> None:
        """The prompt is computed once; samples 1..n-1 share its blocks and recompute only its last token."""
        prompt_len = len(request.prompt_token_ids)
        for index in range(1, request.params.n):
            child = self.new_sequence(request, index, list(request.prompt_token_ids))
            self.block_manager.fork(first, child, prompt_len)
            child.num_computed_tokens = child.num_charged_tokens = prompt_len - 1
            child.kv_present_tokens = prompt_len
            child.status = SequenceStatus.RUNNING
            if self.structured.constrains(first.seq_id):
                self.structured.add_sequence(request.request_id, child.seq_id)
            request.seqs.append(child)
            self.running.append(child)
        request.forked = True

    def finish(self, seq: Sequence) -> None:
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.release(seq)
        seq.status = SequenceStatus.FINISHED
        request = self.requests[seq.request_id]
        if request.finished:
            del self.requests[seq.request_id]
            self.retire_adapters()
            self.policy.on_departure(request.tenancy)
            self.structured.free(seq.request_id, [s.seq_id for s in request.seqs])

    def sequence(self, seq_id: str) -> Sequence | None:
        request_id, _, index = seq_id.rpartition("/")
        request = self.requests.get(request_id)
        if request is None or int(index) >= len(request.seqs):
            return None
        return request.seqs[int(index)]

    # --- observability -------------------------------------------------------------------------------
    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        return self.block_manager.drain_events()

    def stats(self) -> scheduler_pb2.StatsResponse:
        return stats_response(self)
