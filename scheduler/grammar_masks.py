"""Structured outputs on the scheduler's side (vLLM v1's shape): grammars compiled off the step loop
(scheduler/grammar_compilation.py), one matcher per sequence advanced with each sampled token, and each step the
bitmask of the tokens a constrained sequence may sample next, sent to the worker with the step. A request's
bad_words (scheduler/bad_words.py) clear bits of the same bitmask, so they cost what a grammar does and nothing for
the rows without either.

Matchers run off the step loop too, so that one grammar cannot slow the other rows: a token is accepted and the
next mask filled by a task on a small thread pool, and a sequence samples again only once its mask is ready.
xgrammar's work per token is unbounded (`root ::= ((((((((((((([a-z]*)*)*...` compiles in 5 ms, then takes seconds
to fill one mask), while a JSON schema's row takes 5 us in the median and up to 11 ms (SmolLM2's vocabulary). So the
loop waits for the masks being filled, but for no row longer than SLOW_FILL_S: a row whose task runs past that is
slow from then on (until a task of its own is quick again): its tasks go to a pool of their own, the loop no longer
waits for it, and it samples whenever its mask is ready. A step so waits at most SLOW_FILL_S for each row that turns
slow in it, and nothing for the slow ones. A new sequence starts from the mask its grammar's compile made, under the
compile's time limit. The same limit bounds one token's task: a grammar whose masks take longer each token (the
nested stars above double) fails its request then, so the slow pool's thread is lost to it for about that long
only (a fill cannot be stopped either).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from base.structured_output import StructuredOutput
from protos import worker_pb2
from scheduler.bad_words import BadWords
from scheduler.grammar_compilation import CompiledConstraint, GrammarCompilation, next_token_mask, spec_key

SLOW_FILL_S = 0.02           # a row whose task (accept and fill) takes longer is slow: the steps stop waiting for it
FILL_THREADS = 2
SLOW_FILL_THREADS = 1


@dataclass
class Preparation:
    """What a request waits for before it may join the queue: its grammar (shared by the requests with the same
    spec) and its bad words' token ids."""
    submitted_at: float
    grammar_key: str = ""
    grammar: Future | None = None       # -> CompiledConstraint
    bad_words: Future | None = None     # -> list[tuple[int, ...]]

    def done(self) -> bool:
        return all(f is None or f.done() for f in (self.grammar, self.bad_words))


@dataclass
class PreparationFailure:
    request_id: str
    reason: str                 # "" when it did not fail
    overloaded: bool = False    # not the request's fault: the compile threads were busy


@dataclass
class Advance:
    """A task's result: whether the grammar took the tokens, the next mask, and how long it took."""
    accepted: bool
    mask: Any
    seconds: float


@dataclass
class ConstrainedRow:
    """One sequence's constraints: its grammar's matcher, advanced off the step loop, and its bad words."""
    matcher: Any = None                  # xgrammar.GrammarMatcher; None: bad words only
    is_json: bool = False
    bad_words: BadWords | None = None
    mask: Any = None                     # numpy int32 row: what the grammar allows next, once known
    task: Future | None = None           # -> Advance: accepting its new tokens and filling the next mask
    started_at: float = 0.0              # when the task began running (0: still queued)
    slow: bool = False                   # its last task took longer than SLOW_FILL_S
    broken: bool = False                 # the grammar refused a sampled token, or its task ran too long
    thinking_end: tuple[int, ...] = ()   # while the model thinks: the ids that end it, after which the grammar holds
    thinking_tail: tuple[int, ...] = ()  # the last output ids while thinking (the end may span two calls)
    first_mask: Any = None               # the grammar's mask at its start, for the first token after thinking

    def thinking(self) -> bool:
        return bool(self.thinking_end)

    def thoughts_end(self, token_ids: list[int]) -> list[int] | None:
        """The tokens after the end of thinking if these new ones hold it (the grammar's to take); None if not."""
        seen, end = [*self.thinking_tail, *token_ids], self.thinking_end
        for stop in range(len(self.thinking_tail) + 1, len(seen) + 1):
            if tuple(seen[max(0, stop - len(end)):stop]) == end:
                self.thinking_end = self.thinking_tail = ()
                return seen[stop:]
        self.thinking_tail = tuple(seen[len(seen) - len(end) + 1:]) if len(end) > 1 else ()
        return None

    def filling(self) -> bool:
        return self.task is not None and not self.task.done()

    def filling_longer_than(self, seconds: float, now: float) -> bool:
        return self.filling() and self.started_at > 0 and now - self.started_at > seconds


class StructuredOutputManager:
    """Preparations by request id, constrained rows by sequence id. The loop thread polls the compiles and waits
    for the masks of the rows that are not slow."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: list[int], compile_workers: int = 2,
                 compile_timeout: float = 10.0):
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.compile_timeout = compile_timeout
        self.compilation = GrammarCompilation(model_path, vocab_size, sorted(stop_token_ids), compile_workers)
        self.fills = ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="grammar-fill")
        self.slow_fills = ThreadPoolExecutor(SLOW_FILL_THREADS, thread_name_prefix="grammar-fill-slow")
        self.preparing: dict[str, Preparation] = {}
        self.grammars: dict[str, CompiledConstraint] = {}   # request id -> its grammar
        self.json_requests: set[str] = set()
        self.request_bad_words: dict[str, list[tuple[int, ...]]] = {}   # request id -> its bad words' token ids
        self.thinking_ends: dict[str, tuple[int, ...]] = {}   # request id -> the ids its model's thinking ends with
        self.rows: dict[str, ConstrainedRow] = {}
        self.broken: list[tuple[str, str]] = []   # (sequence, why) whose grammar refused a token or ran too long

    # --- compiles ------------------------------------------------------------------------------------
    def submit(self, request_id: str, constraint: StructuredOutput | None, bad_words: tuple[str, ...] = (),
               thinking_end: tuple[int, ...] = ()) -> None:
        """thinking_end: the grammar constrains only what follows these ids in the output (a reasoning model's)."""
        preparation = Preparation(time.monotonic())
        if thinking_end and constraint is not None:
            self.thinking_ends[request_id] = tuple(thinking_end)
        if constraint is not None:
            preparation.grammar_key = spec_key(constraint)
            preparation.grammar = self.compilation.grammar(preparation.grammar_key, constraint)
            if constraint.kind in ("json_schema", "json_object"):
                self.json_requests.add(request_id)
        if bad_words:
            preparation.bad_words = self.compilation.bad_words(bad_words)
        self.preparing[request_id] = preparation

    def collect(self) -> tuple[list[str], list[PreparationFailure]]:
        """The requests whose preparation ended since the last call: ready, and failed."""
        ready, failed = [], []
        for request_id, preparation in list(self.preparing.items()):
            if preparation.done():
                failure = PreparationFailure(request_id, self.take(request_id, preparation))
            elif self.past_deadline(preparation):
                failure = self.timed_out(request_id, preparation)
            else:
                continue
            self.end_preparation(request_id)
            if failure.reason:
                failed.append(failure)
            else:
                ready.append(request_id)
        return ready, failed

    def timed_out(self, request_id: str, preparation: Preparation) -> PreparationFailure:
        """A compile that ran past the limit is the spec's fault; one that never got a compile thread (all busy with
        others, bombs maybe) is the scheduler's load."""
        if preparation.grammar is not None and not preparation.grammar.running():
            return PreparationFailure(request_id, f"the structured output waited {self.compile_timeout:g} s for a "
                                      "compile thread, all busy with other grammars; retry later", overloaded=True)
        return PreparationFailure(request_id, f"the structured output did not compile within "
                                  f"{self.compile_timeout:g} s (--structured-output-compile-timeout)")

    def take(self, request_id: str, preparation: Preparation) -> str:
        """Keep what the request's preparation made; the reason it failed, or ""."""
        try:
            if preparation.grammar is not None:
                self.grammars[request_id] = preparation.grammar.result()
            if preparation.bad_words is not None and (bad_words := preparation.bad_words.result()):
                self.request_bad_words[request_id] = bad_words
        except Exception as e:   # xgrammar reports a bad schema/regex/grammar as RuntimeError or ValueError
            return f"the structured output could not be compiled: {e}"
        return ""

    def past_deadline(self, preparation: Preparation) -> bool:
        """Whether the request has waited longer than the time limit, counted from when xgrammar was loaded."""
        loaded_at = self.compilation.loaded_at
        if loaded_at is None:
            return False
        return time.monotonic() - max(loaded_at, preparation.submitted_at) > self.compile_timeout

    def end_preparation(self, request_id: str) -> None:
        preparation = self.preparing.pop(request_id)
        if preparation.grammar is not None:
            self.compilation.cache.release(preparation.grammar_key)
        if preparation.bad_words is not None:
            preparation.bad_words.cancel()

    # --- sequences -----------------------------------------------------------------------------------
    def add_sequence(self, request_id: str, seq_id: str, token_ids: list[int] = ()) -> None:
        """A row at the start of the output, then advanced through the output tokens already known (resumed)."""
        if request_id not in self.grammars and request_id not in self.request_bad_words:
            return
        row = self.rows[seq_id] = ConstrainedRow(is_json=request_id in self.json_requests)
        if request_id in self.request_bad_words:
            row.bad_words = BadWords(self.request_bad_words[request_id])
        if request_id in self.grammars:
            import xgrammar

            row.matcher = xgrammar.GrammarMatcher(self.grammars[request_id].grammar)
            row.mask = row.first_mask = self.grammars[request_id].first_mask
            row.thinking_end = self.thinking_ends.get(request_id, ())
            if row.thinking():
                row.mask = None   # nothing constrained until the thinking ends
        if token_ids:
            self.accept(seq_id, list(token_ids))

    def constrains(self, seq_id: str) -> bool:
        return seq_id in self.rows

    def is_prepared(self, request_id: str, seq_id: str) -> bool:
        """Whether a sequence added to the manager may join the queue: its request compiled, its mask filled."""
        return request_id not in self.preparing and self.mask_ready(seq_id)

    def accept(self, seq_id: str, token_ids: list[int]) -> None:
        """Advance seq's constraints past its new tokens (the grammar's part as a task). Never called while a task
        runs: a sequence whose mask is not ready samples no token."""
        row = self.rows[seq_id]
        for token_id in token_ids if row.bad_words is not None else ():
            row.bad_words.accept(token_id)
        if row.matcher is None:
            return
        if row.thinking():
            after = row.thoughts_end(token_ids)
            if after is None:
                return
            row.mask, token_ids = row.first_mask, after
            if not token_ids:
                return
        row.mask, row.started_at = None, 0.0
        row.task = (self.slow_fills if row.slow else self.fills).submit(self.advance, row, token_ids)

    def advance(self, row: ConstrainedRow, token_ids: list[int]) -> Advance:
        """On a fill thread: the grammar takes the tokens and says what may follow."""
        row.started_at = start = time.monotonic()
        try:
            accepted = all(row.matcher.accept_token(token_id) for token_id in token_ids)
            mask = next_token_mask(row.matcher, self.vocab_size) if accepted else None
        except Exception:   # xgrammar's error on a state it cannot go on from: as if the grammar refused
            accepted, mask = False, None
        return Advance(accepted, mask, time.monotonic() - start)

    def is_terminated(self, seq_id: str, token_id: int) -> bool:
        """Whether the token ends seq's grammar: a stop token its mask allowed (only where the grammar may end)."""
        row = self.rows.get(seq_id)
        return row is not None and row.matcher is not None and not row.thinking() and token_id in self.stop_token_ids

    # --- masks ---------------------------------------------------------------------------------------
    def wait_for_masks(self) -> None:
        """Wait for the tasks of the rows that are not slow; a row whose task has run longer than SLOW_FILL_S turns
        slow. Rows queued behind slow tasks are not waited for past SLOW_FILL_S (they sample in a later step)."""
        while pending := [row for row in self.rows.values() if row.filling() and not row.slow]:
            done, _ = wait([row.task for row in pending], timeout=SLOW_FILL_S)
            now = time.monotonic()
            turned_slow = [row for row in pending if row.filling_longer_than(SLOW_FILL_S, now)]
            for row in turned_slow:
                row.slow = True
            if not done and not turned_slow:
                return

    def mask_ready(self, seq_id: str) -> bool:
        """Whether seq may sample: not constrained, or its constraints know what it may sample next."""
        row = self.rows.get(seq_id)
        if row is None:
            return True
        if row.task is not None and row.task.done():
            self.take_advance(seq_id, row)
        return row.task is None and not row.broken and (row.matcher is None or row.mask is not None
                                                         or row.thinking())

    def take_advance(self, seq_id: str, row: ConstrainedRow) -> None:
        advance, row.task = row.task.result(), None
        row.mask, row.slow = advance.mask, advance.seconds > SLOW_FILL_S
        if not advance.accepted:   # never expected: the worker applied the grammar's mask
            self.break_row(seq_id, row, "a sampled token broke the structured output")

    def break_row(self, seq_id: str, row: ConstrainedRow, reason: str) -> None:
        row.broken = True
        self.broken.append((seq_id, reason))

    def take_broken(self) -> list[tuple[str, str]]:
        """The sequences, and why, whose grammar refused a sampled token or took longer than the time limit to
        fill one token's mask, since the last call."""
        now = time.monotonic()
        for seq_id, row in self.rows.items():
            if not row.broken and row.filling_longer_than(self.compile_timeout, now):
                self.break_row(seq_id, row, f"the structured output took over {self.compile_timeout:g} s to find "
                               "the tokens allowed next (--structured-output-compile-timeout)")
        broken, self.broken = self.broken, []
        return broken

    def bitmasks(self, seq_ids: list[str]) -> list[worker_pb2.TokenBitmask]:
        """The allowed next tokens of each sequence, as the worker applies them (each one's mask is ready)."""
        entries = []
        for seq_id in seq_ids:
            row = self.rows[seq_id]
            mask = self.allowed(row, row.mask, row.bad_words)
            row.mask = None   # this token's: the next one needs the token sampled now
            entries.append(worker_pb2.TokenBitmask(seq_id=seq_id, bits=mask.tobytes()))
        return entries

    def allowed(self, row: ConstrainedRow, grammar_mask: Any, bad_words: BadWords | None) -> Any:
        """What a row may sample: its grammar's mask (None: anything), less control characters in JSON and the
        tokens that would complete a bad word."""
        import numpy

        mask = numpy.full((self.vocab_size + 31) // 32, -1, dtype=numpy.int32)   # all allowed
        if grammar_mask is not None:
            mask[:] = grammar_mask
        if row.is_json and not row.thinking():
            # xgrammar 0.2.8 lets a length-bounded JSON string (maxLength) hold raw control characters, which
            # JSON forbids; compact JSON needs none outside strings either
            mask &= self.compilation.no_control_chars
        if bad_words is not None:
            clear_bits(mask, bad_words.banned_next())
        return mask

    def free(self, request_id: str, seq_ids: list[str]) -> None:
        if request_id in self.preparing:
            self.end_preparation(request_id)
        self.grammars.pop(request_id, None)
        self.json_requests.discard(request_id)
        self.request_bad_words.pop(request_id, None)
        self.thinking_ends.pop(request_id, None)
        for seq_id in seq_ids:
            self.rows.pop(seq_id, None)


def thinking_end(end_ids: tuple[int, ...], prompt_token_ids: list[int]) -> tuple[int, ...]:
    """What a grammar waits for in the output before it constrains: a reasoning model's end of thinking, unless the
    prompt holds it already (a template that closed the thinking: Qwen3's enable_thinking false; vLLM's check)."""
    end = list(end_ids)
    if not end or any(token_id == end[0] and prompt_token_ids[i:i + len(end)] == end
                      for i, token_id in enumerate(prompt_token_ids)):
        return ()
    return tuple(end)


def clear_bits(row: Any, token_ids: list[int]) -> None:
    """Disallow token_ids in one int32 bitmask row, unless that would leave no token (the grammar wins)."""
    import numpy

    kept = row.copy()
    words = row.view(numpy.uint32)
    for token_id in token_ids:
        if token_id < words.size * 32:
            words[token_id >> 5] &= ~numpy.uint32(1 << (token_id & 31))
    if not row.any():
        row[:] = kept
