"""Turns one StepRequest into one forward pass: packs tokens, builds attention metadata, samples.

A sequence with proposed tokens (speculative decoding) is computed over its last token and the proposals, and
sampled at each of those positions as if each were its next decode (seeded draws depend on the position only): it
keeps the sampled tokens up to the first that differs from the proposal. With a proposal that is one token (prompt
lookup's), that is exact rejection sampling: a proposal x is kept with probability p(x)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from base.sampling_params import SamplingParams
from gpu_worker.cuda.cuda_graphs import DecodeGraphs, DecodeRows
from gpu_worker.draft_model import DraftModel
from gpu_worker.interrupts import Interrupts, StepInterrupted
from gpu_worker.kv_pool import KVPool
from gpu_worker.lora.adapter_store import AdapterStore
from gpu_worker.lora.lora_slots import LoraSlots
from gpu_worker.model import AttentionBatch
from gpu_worker.parallel.group import TensorParallel
from gpu_worker.sampling.sampler import Sampled, SampleRow, prompt_token_logprobs, sample_on_device
from kernels import torch_paged
from kernels.staging import tensor_on, to_device
from protos import common_pb2, worker_pb2

PROMPT_LOGITS_ROWS = 256   # prompt positions whose full-vocabulary logits are held at once
PENDING = -1               # in token_ids: the token a launched step is still sampling (read on the device)


@dataclass
class SequenceState:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    sample_index: int
    num_computed_tokens: int = 0
    kv_present_tokens: int = 0       # positions below this are already in (shared) blocks: don't store them
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None   # gathered over the prefill; None: not asked
    embedding: list[float] | None = None   # return_embedding: taken when the prefill ends, sent with the token
    lora_name: str = ""              # the LoRA adapter it runs with ("": the base model)
    fed_row: int = -1                # its last token is PENDING: this row of the unfinished step's sampled ids


@dataclass
class ScheduledChunk:
    seq: SequenceState
    start: int
    num_tokens: int
    drafts: list[int] = field(default_factory=list)   # its last num_drafts tokens: proposals to verify

    def __post_init__(self) -> None:
        # whether it reaches the end of its sequence's known tokens (once sampled, a PENDING token follows)
        self.samples = self.end == len(self.seq.token_ids)

    @property
    def num_sampled_rows(self) -> int:
        return 1 + len(self.drafts) if self.samples else 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class LaunchedStep:
    """A step whose forward is queued (on a CPU: done) and whose tokens are sampled on the device."""
    req: worker_pb2.StepRequest
    chunks: list[ScheduledChunk]
    launched_at: float = 0.0          # perf_counter() when launch() began
    idle_seconds: float = 0.0         # how long the device had nothing to do before it (idle_before())
    collectives_before: float = 0.0   # under tensor parallelism: the rank's collective seconds at its launch
    seconds: float = 0.0              # the host's time in its forward, sampling and waiting for the ids
    num_fed_tokens: int = 0           # input positions read from the previous step's sampled ids (feed())
    returned_at: float = 0.0          # when launch() returned
    sampled: Sampled | None = None    # None: no row samples
    interrupted: bool = False         # stopped between two layers (gpu_worker/interrupts.py): nothing computed

    def ready(self) -> bool:
        """Whether its tokens are on the host (finish() would not wait for the device)."""
        return self.sampled is None or self.sampled.ready()


@dataclass
class ModelRunner:
    model: torch.nn.Module    # a family's model (gpu_worker/models)
    pool: KVPool
    backend: object
    device: torch.device
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()     # what min_tokens holds back
    seqs: dict[str, SequenceState] = field(default_factory=dict)
    graphs: DecodeGraphs | None = None      # decode steps replayed from CUDA graphs (None: every step eager)
    draft: DraftModel | None = None         # speculative decoding's draft model (it follows every step)
    lora: LoraSlots | None = None           # with --enable-lora: the adapters' device slots
    adapters: AdapterStore | None = None    # and the adapters loaded
    tp: TensorParallel | None = None        # this rank's group, under tensor parallelism
    vocab_size: int = 0                     # the whole vocabulary's (a rank's head holds a slice of it)
    interrupts: Interrupts = field(default_factory=Interrupts)   # steps the scheduler asked to stop

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)
        self.unfinished: LaunchedStep | None = None   # launched, its tokens not yet on the host (launch())
        self.last_finished_at = 0.0                    # when the last finish() returned
        self.num_fed = 0                               # positions the last feed() filled on the device
        self.interruptible_step = 0                    # the step() running, where it may be cut short; 0: none

    @torch.inference_mode()
    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        """One step, start to end: its tokens are on the host when it returns."""
        if self.unfinished is not None:
            raise RuntimeError("step() while a launched step is unfinished: finish() it first")
        self.interruptible_step = req.step_id if self.may_interrupt(req) else 0
        try:
            self.launch(req)
        finally:
            self.interruptible_step = 0
        return self.finish()

    def may_interrupt(self, req: worker_pb2.StepRequest) -> bool:
        """Whether req may stop between two layers when asked: on a CPU, where a step's layers run as the host
        reaches them, one rank alone, and nothing the step would consume on the host before its forward (a draft
        model follows each step; proposals and token masks are the scheduler's for this step only)."""
        return (self.device.type == "cpu" and self.tp is None and self.draft is None and not req.token_bitmasks
                and not any(seq.draft_token_ids for seq in req.cached_seqs))

    @torch.inference_mode()
    def launch(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResult | None:
        """Queue req's forward, then finish the step launched before it (its tokens come back while req's forward
        runs; positions whose tokens it was still sampling read them on the device), then sample req's tokens on
        the device. Returns that earlier step's result (None: there was none); finish() gives req's."""
        now = time.perf_counter()
        launched = LaunchedStep(req, self.prepare(req), now, self.idle_before(now),
                                self.tp.collective_seconds if self.tp else 0.0)
        logits = None
        if launched.chunks:
            started = time.perf_counter()
            try:
                logits = self.forward(launched.chunks)
            except StepInterrupted:   # its sequences stay as they were: the scheduler sends these positions again
                launched.interrupted = True
            launched.num_fed_tokens = self.num_fed
            launched.seconds = time.perf_counter() - started
        earlier = self.finish()
        if logits is not None:
            started = time.perf_counter()
            launched.sampled = self.sample_on_device(launched.chunks, logits, req)
            launched.seconds += time.perf_counter() - started
        self.unfinished = launched
        launched.returned_at = time.perf_counter()
        return earlier

    def idle_before(self, now: float) -> float:
        """How long the device has had nothing to do: since the last step finished, or since the unfinished one's
        launch returned if it is done (on a CPU it is, once launch() returns; on a GPU this bounds the wait from
        above), else 0: it still computes."""
        if self.unfinished is None:
            return now - self.last_finished_at if self.last_finished_at else 0.0
        if self.device.type == "cpu" or self.unfinished.ready():
            return now - self.unfinished.returned_at
        return 0.0

    @torch.inference_mode()
    def finish(self) -> worker_pb2.StepResult | None:
        """The launched step's result once its tokens are on the host (None: no step is unfinished)."""
        launched, self.unfinished = self.unfinished, None
        if launched is None:
            return None
        result = self.result_of(launched)
        self.last_finished_at = time.perf_counter()
        result.idle_seconds = launched.idle_seconds
        result.busy_seconds = self.last_finished_at - launched.launched_at
        return result

    def result_of(self, launched: LaunchedStep) -> worker_pb2.StepResult:
        """Its tokens to the host, kept by their sequences (and proposed after, with a draft model)."""
        result = worker_pb2.StepResult(step_id=launched.req.step_id, num_fed_tokens=launched.num_fed_tokens,
                                       interrupted=launched.interrupted, forward_seconds=launched.seconds)
        if not launched.chunks or launched.interrupted:
            return result
        tokens, logprobs = [], []
        if launched.sampled is not None:
            started = time.perf_counter()
            tokens, logprobs = launched.sampled.to_host()
            launched.seconds += time.perf_counter() - started
        result.forward_seconds = launched.seconds
        if self.tp is not None:
            tokens = self.tp.same_tokens(tokens)
            result.collective_seconds = self.tp.collective_seconds - launched.collectives_before
        row, sampled = 0, []
        for chunk in launched.chunks:
            num_rows = chunk.num_sampled_rows
            kept = verified(chunk.drafts, tokens[row:row + num_rows])
            self.keep(chunk, kept, logprobs[row:row + len(kept)], result)
            row += num_rows
            if num_rows:
                sampled.append(chunk.seq)
        if self.draft is not None and launched.req.num_proposals:
            started = time.perf_counter()
            proposals = self.draft.propose(sampled, launched.req.num_proposals, self.decode_batch)
            result.proposals.extend(worker_pb2.Proposal(seq_id=seq_id, token_ids=proposed)
                                    for seq_id, proposed in proposals.items())
            result.forward_seconds += time.perf_counter() - started
        return result

    def prepare(self, req: worker_pb2.StepRequest) -> list[ScheduledChunk]:
        """Apply what comes before the step's forward (freed sequences, block copies, adapters); its chunks in row
        order: decodes first, shortest context first, then prefill chunks (each attention group a run of rows)."""
        for seq_id in req.freed_seq_ids:
            self.seqs.pop(seq_id, None)
        for copy in req.block_copies:
            self.pool.copy_block(copy.src, copy.dst)
            if self.draft is not None:
                self.draft.pool.copy_block(copy.src, copy.dst)
        for name in req.unloaded_lora_adapters:
            self.adapters.unload(name)
        for placed in req.lora_slots:
            self.lora.place(placed.slot, self.adapters.get(placed.name))
        chunks = self.register(req)
        chunks.sort(key=self.row_order)
        return chunks

    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """The sampling rows' logits (None: no row samples), queued on the device."""
        forward = self.graph_forward(chunks) if self.replays(chunks) else self.eager_forward(chunks)
        return forward()

    def sample_on_device(self, chunks: list[ScheduledChunk], logits: torch.Tensor, req: worker_pb2.StepRequest
                         ) -> Sampled:
        """Sample the chunks' rows on the device; each sequence that gains one token holds it as PENDING until
        finish(), a later step's position reading it from the sampled ids."""
        bitmasks: dict[str, list[bytes]] = {}
        for mask in req.token_bitmasks:   # one per position it samples at
            bitmasks.setdefault(mask.seq_id, []).append(mask.bits)
        rows = [row for c in chunks for row in sample_rows(c, bitmasks.get(c.seq.seq_id, []))]
        sampled = sample_on_device(logits, rows, self.generator, self.eos_token_ids)
        row = 0
        for chunk in chunks:
            if chunk.samples and not chunk.drafts:
                chunk.seq.token_ids.append(PENDING)
                chunk.seq.fed_row = row
            row += chunk.num_sampled_rows
        return sampled

    def fed_rows(self, chunks: list[ScheduledChunk]) -> list[tuple[int, int]]:
        """(input row, row of the unfinished step's sampled ids) for each position whose token it is sampling."""
        pairs, row = [], 0
        for chunk in chunks:
            pending = len(chunk.seq.token_ids) - 1
            if chunk.seq.fed_row >= 0 and chunk.start <= pending < chunk.end:
                pairs.append((row + pending - chunk.start, chunk.seq.fed_row))
            row += chunk.num_tokens
        return pairs

    def feed(self, input_ids: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
        """The pending tokens into input_ids, device to device: the host never waits for them."""
        pairs = self.fed_rows(chunks)
        self.num_fed = len(pairs)
        if pairs:
            rows, sampled_rows = zip(*pairs)
            tokens = self.unfinished.sampled.tokens[tensor_on(sampled_rows, torch.long, self.device)]
            input_ids[tensor_on(rows, torch.long, self.device)] = tokens.to(input_ids.dtype)

    def decode_batch(self, rows: list[tuple[SequenceState, int]]) -> AttentionBatch:
        """One decode row per (sequence, position), for the draft model's proposals."""
        slots = tensor_on([self.slot_of(seq, position) for seq, position in rows], torch.long, self.device)
        meta = self.metadata([ScheduledChunk(seq, position, 1) for seq, position in rows])
        return AttentionBatch(self.backend, slots, [(slice(0, len(rows)), meta)])

    @staticmethod
    def keep(chunk: ScheduledChunk, kept: list[int], logprobs: list, result: worker_pb2.StepResult) -> None:
        """The chunk's sampled tokens join its sequence (its rejected proposals leave it) and the result."""
        seq = chunk.seq
        unknown = len(chunk.drafts) + (seq.fed_row >= 0)   # its proposals, or the token held PENDING
        del seq.token_ids[len(seq.token_ids) - unknown:]
        seq.fed_row = -1
        seq.num_computed_tokens = chunk.end - len(chunk.drafts) + max(0, len(kept) - 1)
        for token, logprob in zip(kept, logprobs):
            seq.token_ids.append(token)
            entry = result.sampled.add(seq_id=seq.seq_id, token_id=token)
            if logprob is not None:
                entry.logprob.CopyFrom(logprob)
            if seq.prompt_logprobs is not None:   # the prefill is complete: they go out once
                entry.prompt_logprobs.extend(seq.prompt_logprobs)
                seq.prompt_logprobs = None
            if seq.embedding is not None:
                entry.embedding.extend(seq.embedding)
                seq.embedding = None

    def register(self, req: worker_pb2.StepRequest) -> list[ScheduledChunk]:
        chunks = []
        for new in req.new_seqs:
            seq = SequenceState(new.seq_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                                SamplingParams.from_proto(new.sampling, trusted=True), new.sample_index,
                                kv_present_tokens=new.kv_present_tokens, lora_name=new.lora_name)
            if new.lora_name and self.lora is None:
                raise ValueError(f"sequence {new.seq_id}: LoRA adapter {new.lora_name!r}, but LoRA is off")
            if wants_prompt_logprobs(new):
                seq.prompt_logprobs = []
            self.seqs[new.seq_id] = seq
            chunks.append(ScheduledChunk(seq, new.num_computed_tokens, new.num_scheduled_tokens))
        for cached in req.cached_seqs:
            seq = self.seqs[cached.seq_id]
            if cached.replaces_block_table:
                seq.block_ids = list(cached.new_block_ids)
            else:
                seq.block_ids.extend(cached.new_block_ids)
            seq.token_ids.extend(cached.draft_token_ids)
            chunks.append(ScheduledChunk(seq, cached.num_computed_tokens, cached.num_scheduled_tokens,
                                         list(cached.draft_token_ids)))
        for chunk in chunks:
            if chunk.end > len(chunk.seq.token_ids):
                raise ValueError(f"sequence {chunk.seq.seq_id}: scheduled past its known tokens")
        return chunks

    def row_order(self, chunk: ScheduledChunk) -> tuple:
        """Decodes first, shortest context first, then prefill chunks; with LoRA on a backend that runs all decodes
        as one group, by adapter first, so that the rows of an adapter are adjacent (kernels/cpu_lora.py)."""
        if self.lora is None or getattr(self.backend, "pads_decodes", lambda: False)():
            return chunk.num_tokens > 1, chunk.end
        return chunk.num_tokens > 1, self.lora.slot_of(chunk.seq.lora_name), chunk.end

    def replays(self, chunks: list[ScheduledChunk]) -> bool:
        """A step of decodes only, each sampling, none gathering prompt logprobs, that a captured graph holds."""
        return (self.graphs is not None and all(c.num_tokens == 1 and c.samples and c.seq.prompt_logprobs is None
                                                and not c.drafts and not c.seq.params.return_embedding
                                                for c in chunks)
                and self.graphs.fits(len(chunks), max(c.end for c in chunks)))   # LoRA orders by adapter first

    def graph_forward(self, chunks: list[ScheduledChunk]) -> Callable[[], torch.Tensor]:
        """The step's inputs in the graphs' buffers; the returned call replays and gives the logits."""
        rows = DecodeRows([c.seq.token_ids[c.start] for c in chunks], [c.start for c in chunks],
                          [self.slot_of(c.seq, c.start) for c in chunks], [c.seq.block_ids for c in chunks],
                          [self.lora.slot_of(c.seq.lora_name) for c in chunks] if self.lora is not None else [])
        replay = self.graphs.prepare(rows)
        self.feed(self.graphs.inputs.input_ids, chunks)
        return replay

    def eager_forward(self, chunks: list[ScheduledChunk]) -> Callable[[], torch.Tensor | None]:
        """The step's inputs and attention metadata; the returned call runs the model and gives the sampling
        rows' logits (None: no row samples)."""
        input_ids, positions, slots = self.pack(chunks)
        self.feed(input_ids, chunks)
        batch = self.attention_batch(chunks, slots)
        if self.lora is not None:
            self.lora.set_rows([self.lora.slot_of(c.seq.lora_name) for c in chunks for _ in range(c.num_tokens)])
        lengths = torch.tensor([c.num_tokens for c in chunks])
        ends = lengths.cumsum(0) - 1
        logit_rows = tensor_on([row for c, end in zip(chunks, ends.tolist())
                                for row in range(end - c.num_sampled_rows + 1, end + 1)], torch.long, self.device)

        def forward() -> torch.Tensor | None:
            hidden = self.model(input_ids, positions, self.kv_layers(), batch)
            if self.draft is not None:
                self.draft.follow(input_ids, positions, batch)
            self.gather_prompt_logprobs(chunks, hidden, (ends - lengths + 1).tolist())
            self.gather_embeddings(chunks, hidden, ends.tolist())
            return self.compute_logits(hidden[logit_rows]) if logit_rows.numel() else None
        return forward

    def kv_layers(self):
        """The pool's layers, as the model's forward reads them: in an interruptible step, each after a look at
        whether the step was asked to stop."""
        if not self.interruptible_step:
            return self.pool.layers
        return self.interrupts.layers(self.pool.layers, self.interruptible_step)

    def gather_prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, first_rows: list[int]
                               ) -> None:
        """Score the prompt tokens this step's chunks reach, for the sequences that asked: position p's logits
        score token p + 1. Only their rows get logits; the rest of the batch pays nothing."""
        for chunk, first_row in zip(chunks, first_rows):
            seq = chunk.seq
            stop = min(chunk.end, seq.num_prompt_tokens - 1)
            if seq.prompt_logprobs is None or stop <= chunk.start:
                continue
            for start in range(chunk.start, stop, PROMPT_LOGITS_ROWS):
                end = min(start + PROMPT_LOGITS_ROWS, stop)
                rows = hidden[first_row + start - chunk.start:first_row + end - chunk.start]
                logits = self.compute_logits(rows)
                seq.prompt_logprobs.extend(prompt_token_logprobs(logits, seq.token_ids[start + 1:end + 1],
                                                                 seq.params.prompt_logprobs))

    @staticmethod
    def gather_embeddings(chunks: list[ScheduledChunk], hidden: torch.Tensor, last_rows: list[int]) -> None:
        """The prompt's embedding, for the sequences that asked, from the step whose chunk ends their prompt: its
        last position's hidden state (after the final norm), L2-normalized in fp32."""
        for chunk, row in zip(chunks, last_rows):
            if chunk.seq.params.return_embedding and chunk.end == chunk.seq.num_prompt_tokens:
                chunk.seq.embedding = torch.nn.functional.normalize(hidden[row].float(), dim=-1).tolist()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        return self.tp.gather_vocab(logits, self.vocab_size) if self.tp is not None else logits

    def slot_of(self, seq: SequenceState, position: int) -> int:
        """Where the position's K and V go in the pool; -1 where a shared block already holds them."""
        if position < seq.kv_present_tokens:
            return -1
        block_size = self.pool.block_size
        return seq.block_ids[position // block_size] * block_size + position % block_size

    def pack(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids, positions, slots = [], [], []
        for c in chunks:
            input_ids.extend(c.seq.token_ids[c.start:c.end])
            positions.extend(range(c.start, c.end))
            slots.extend(self.slot_of(c.seq, p) for p in range(c.start, c.end))
        as_tensor = lambda xs: tensor_on(xs, torch.long, self.device)  # noqa: E731
        return as_tensor(input_ids), as_tensor(positions), as_tensor(slots)

    def attention_batch(self, chunks: list[ScheduledChunk], slots: torch.Tensor) -> AttentionBatch:
        num_decode = sum(1 for c in chunks if c.num_tokens == 1)
        groups, row = [], 0
        decodes = chunks[:num_decode]
        # Padding matters only to a backend that pads every decode to the longest context.
        buckets = decode_buckets(decodes) if getattr(self.backend, "pads_decodes", lambda: False)() else [decodes]
        for group in [b for b in buckets if b] + ([chunks[num_decode:]] if num_decode < len(chunks) else []):
            num_rows = sum(c.num_tokens for c in group)
            groups.append((slice(row, row + num_rows), self.metadata(group)))
            row += num_rows
        windows = {w: self.window_groups(chunks, num_decode, w) for w in self.windows_in_reach(chunks)}
        return AttentionBatch(self.backend, slots, groups, windows)

    def windows_in_reach(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The model's sliding windows that some context of this step is longer than, and 0 where its scores are
        softcapped (its global layers need torch_paged too)."""
        longest = max(c.end for c in chunks)
        reached = [w for w in self.model.attention_windows if w < longest]
        return reached + [0] if self.model.attention_softcap else reached

    def window_groups(self, chunks: list[ScheduledChunk], num_decode: int, window: int) -> list[tuple[slice, object]]:
        """The decodes, then the prefill chunks, prepared for a window (0: causal only, for softcapped scores)."""
        groups, row = [], 0
        for group in (chunks[:num_decode], chunks[num_decode:]):
            if group:
                num_rows = sum(c.num_tokens for c in group)
                groups.append((slice(row, row + num_rows), self.metadata(group, window=window)))
                row += num_rows
        return groups

    def metadata(self, chunks: list[ScheduledChunk], window: int | None = None):
        """The backend's metadata for these chunks, with a window if given (0: none); torch_paged's with masks
        where the model softcaps its scores (no kernel does)."""
        width = max((c.end + self.pool.block_size - 1) // self.pool.block_size for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, c in enumerate(chunks):
            blocks = c.seq.block_ids[:width]
            tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        context_lens = torch.tensor([c.end for c in chunks], dtype=torch.int32)
        query_lens = torch.tensor([c.num_tokens for c in chunks], dtype=torch.int32)
        to = lambda t: to_device(t, self.device)  # noqa: E731
        # query_lens stays on the host: the backends read its longest entry, which on a GPU would wait for it
        if window is not None and self.model.attention_softcap:
            return torch_paged.prepare(to(tables), to(context_lens), query_lens, self.pool.block_size, window,
                                       masked=True)
        return self.backend.prepare(to(tables), to(context_lens), query_lens, self.pool.block_size, window or 0)


def sample_rows(chunk: ScheduledChunk, bitmasks: list[bytes]) -> list[SampleRow]:
    """What sampling sees at each position the chunk samples: its last, or with proposals, the last known token's
    and each proposal's, each with the tokens before it as its history and its own mask if constrained."""
    if not chunk.samples:
        return []
    seq = chunk.seq
    known = len(seq.token_ids) - len(chunk.drafts)
    histories = [seq.token_ids[:known + i] for i in range(len(chunk.drafts))] + [seq.token_ids]
    return [SampleRow(seq.params, history, seq.num_prompt_tokens, seq.sample_index,
                      bitmasks[i] if i < len(bitmasks) else None) for i, history in enumerate(histories)]


def verified(drafts: list[int], sampled: list[int]) -> list[int]:
    """The sampled tokens kept: each one whose position followed accepted proposals, up to and including the first
    that differs from its proposal (or the one after the last proposal)."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[:i + 1]
    return sampled


def wants_prompt_logprobs(new: worker_pb2.NewSequence) -> bool:
    """Sample 0 of a request that asked, prefilled from its first token (the scheduler skips prefix-cache hits for
    it); one that already has output sent them before it was preempted."""
    return (new.sampling.HasField("prompt_logprobs") and new.sample_index == 0 and new.num_computed_tokens == 0
            and len(new.token_ids) == new.num_prompt_tokens)


def decode_buckets(decodes: list[ScheduledChunk], max_buckets: int = 4,
                   min_size: int = 8) -> list[list[ScheduledChunk]]:
    """Split decodes (sorted by context length) so that each group pads little: a group closes once the next
    context is 1.5x its shortest."""
    buckets: list[list[ScheduledChunk]] = []
    for chunk in decodes:
        if (buckets and (len(buckets) == max_buckets or len(buckets[-1]) < min_size
                         or chunk.end <= 1.5 * buckets[-1][0].end)):
            buckets[-1].append(chunk)
        else:
            buckets.append([chunk])
    return buckets
