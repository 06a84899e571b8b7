"""Structured outputs on the scheduler's side (vLLM v1's shape): grammars compiled off the step loop, one matcher
per sequence advanced with each sampled token, and each step the bitmask of the tokens a constrained sequence may
sample next, sent to the worker with the step. A request's bad_words (scheduler/bad_words.py) clear bits of the
same bitmask, so they cost what a grammar does and nothing for the rows without either.

xgrammar (and with it torch) is imported in the compile thread, on the first constrained request: a scheduler
that never sees one never loads it, and the step loop never waits for it.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from base.structured_output import StructuredOutput
from protos import worker_pb2
from scheduler.bad_words import BadWords, bad_word_token_ids

GRAMMAR_CACHE_BYTES = 256 << 20     # compiled grammars kept (xgrammar's cache evicts the least recently used)
COMPILE_THREADS = 2


@dataclass
class Prepared:
    """What a request's constraints compile to."""
    grammar: Any = None                     # xgrammar.CompiledGrammar; None: no structured output
    bad_words: list[tuple[int, ...]] = field(default_factory=list)   # their token ids


@dataclass
class GrammarCompilation:
    """Compiles on a thread pool; builds xgrammar's tokenizer info and compiler once, on first use."""
    model_path: str
    vocab_size: int
    stop_token_ids: list[int]
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile"))
    lock: threading.Lock = field(default_factory=threading.Lock)
    compiler: Any = None
    tokenizer: Any = None
    no_control_chars: Any = None   # numpy int32 bitmask: the tokens without a byte below 0x20

    def submit(self, constraint: StructuredOutput | None, bad_words: tuple[str, ...] = ()) -> Future:
        return self.executor.submit(self.prepare, constraint, bad_words)

    def prepare(self, constraint: StructuredOutput | None, bad_words: tuple[str, ...]) -> Prepared:
        self.get_compiler()
        grammar = self.compile(constraint) if constraint is not None else None
        return Prepared(grammar, bad_word_token_ids(self.tokenizer, bad_words))

    def compile(self, constraint: StructuredOutput) -> Any:
        compiler = self.get_compiler()
        if constraint.kind == "json_schema":
            # compact JSON: with any whitespace allowed a weak model may spend its whole budget on blanks
            return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
        if constraint.kind == "json_object":   # an object, as OpenAI means it (xgrammar's builtin JSON: any value)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if constraint.kind == "regex":
            return compiler.compile_regex(constraint.spec)
        if constraint.kind == "grammar":
            return compiler.compile_grammar(constraint.spec)
        return compiler.compile_grammar(choice_grammar(constraint.choices))

    def get_compiler(self) -> Any:
        with self.lock:
            if self.compiler is None:
                import xgrammar
                from transformers import AutoTokenizer

                self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                self.compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
                self.no_control_chars = control_char_free_bitmask(info.decoded_vocab, self.vocab_size)
            return self.compiler

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def control_char_free_bitmask(decoded_vocab: list[bytes], vocab_size: int) -> Any:
    import numpy

    allowed = numpy.zeros((vocab_size + 31) // 32 * 32, dtype=bool)
    allowed[:len(decoded_vocab)] = [min(token, default=0x20) >= 0x20 for token in decoded_vocab]
    return numpy.packbits(allowed, bitorder="little").view(numpy.int32)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are xgrammar's EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """Grammars by request id, matchers by sequence id. The loop thread polls compilations; nothing here blocks."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.compilation = GrammarCompilation(model_path, vocab_size, sorted(stop_token_ids))
        self.compiling: dict[str, Future] = {}      # request id -> its grammar being compiled
        self.grammars: dict[str, Any] = {}          # request id -> xgrammar.CompiledGrammar
        self.json_requests: set[str] = set()
        self.matchers: dict[str, Any] = {}          # seq id -> xgrammar.GrammarMatcher
        self.json_seqs: set[str] = set()            # seq ids whose matcher is a JSON grammar
        self.request_bad_words: dict[str, list[tuple[int, ...]]] = {}   # request id -> its bad words' token ids
        self.bad_words: dict[str, BadWords] = {}     # seq id -> its bad words

    def submit(self, request_id: str, constraint: StructuredOutput | None, bad_words: tuple[str, ...] = ()) -> None:
        self.compiling[request_id] = self.compilation.submit(constraint, bad_words)
        if constraint is not None and constraint.kind in ("json_schema", "json_object"):
            self.json_requests.add(request_id)

    def collect(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The requests whose compilation ended since the last call: (compiled, [(failed, reason)])."""
        compiled, failed = [], []
        for request_id, future in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                prepared = future.result()
                if prepared.grammar is not None:
                    self.grammars[request_id] = prepared.grammar
                if prepared.bad_words:
                    self.request_bad_words[request_id] = prepared.bad_words
                compiled.append(request_id)
            except Exception as e:   # xgrammar reports a bad schema/regex/grammar as RuntimeError or ValueError
                failed.append((request_id, f"the structured output could not be compiled: {e}"))
        return compiled, failed

    def add_sequence(self, request_id: str, seq_id: str, token_ids: list[int] = ()) -> None:
        """A matcher (and bad words) at the start of the output, advanced through the output tokens already known."""
        if request_id in self.request_bad_words:
            self.bad_words[seq_id] = BadWords(self.request_bad_words[request_id])
        if request_id in self.grammars:
            import xgrammar

            self.matchers[seq_id] = xgrammar.GrammarMatcher(self.grammars[request_id])
            if request_id in self.json_requests:
                self.json_seqs.add(seq_id)
        for token_id in token_ids:
            self.accept(seq_id, token_id)

    def constrains(self, seq_id: str) -> bool:
        return seq_id in self.matchers or seq_id in self.bad_words

    def accept(self, seq_id: str, token_id: int) -> bool:
        """Advance seq's matcher; False if the grammar refused the token (it never should: the mask allowed it)."""
        if seq_id in self.bad_words:
            self.bad_words[seq_id].accept(token_id)
        return seq_id not in self.matchers or self.matchers[seq_id].accept_token(token_id)

    def is_terminated(self, seq_id: str) -> bool:
        matcher = self.matchers.get(seq_id)
        return matcher is not None and matcher.is_terminated()

    def bitmasks(self, seq_ids: list[str]) -> list[worker_pb2.TokenBitmask]:
        """The allowed next tokens of each sequence, as the worker applies them."""
        if not seq_ids:
            return []
        import xgrammar

        masks = xgrammar.allocate_token_bitmask(len(seq_ids), self.vocab_size)   # all allowed
        for row, seq_id in enumerate(seq_ids):
            if seq_id in self.matchers:
                self.matchers[seq_id].fill_next_token_bitmask(masks, row)
        rows = masks.numpy()
        for row, seq_id in enumerate(seq_ids):
            if seq_id in self.json_seqs:
                # xgrammar 0.2.8 lets a length-bounded JSON string (maxLength) hold raw control characters,
                # which JSON forbids; compact JSON needs none outside strings either
                rows[row] &= self.compilation.no_control_chars
            if seq_id in self.bad_words:
                clear_bits(rows[row], self.bad_words[seq_id].banned_next())
        return [worker_pb2.TokenBitmask(seq_id=seq_id, bits=rows[i].tobytes()) for i, seq_id in enumerate(seq_ids)]

    def free(self, request_id: str, seq_ids: list[str]) -> None:
        future = self.compiling.pop(request_id, None)
        if future is not None:
            future.cancel()
        self.grammars.pop(request_id, None)
        self.json_requests.discard(request_id)
        self.request_bad_words.pop(request_id, None)
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)
            self.json_seqs.discard(seq_id)
            self.bad_words.pop(seq_id, None)


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
