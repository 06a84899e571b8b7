"""Grammar compiles for the scheduler: each distinct spec once (by its hash), on a bounded pool of threads, and a
request waits for its grammar at most --structured-output-compile-timeout.

An xgrammar compile cannot be cancelled, and a JSON schema of 1000 optional properties takes 2.4 s (cubic in their
number). Threads, not processes, compile: a CompiledGrammar does not pickle, its JSON form
(serialize_json) costs 1-25x the compile to make and read back (an object of 500 properties: compiled in 0.3 s,
handed over in 6.4 s as 84 MB) and a fresh process needs 2.4 s to import xgrammar. So a compile past the timeout
fails the requests waiting for it while its thread runs on to the end; the pool's size is the bound: at most
--structured-output-compile-workers compiles run at once, abandoned ones included, so a flood of bombs holds that
many cores and no more, and the requests queued behind them fail at the timeout rather than wait for ever. A
compile that ends after its requests gave up is still cached (a slow but honest spec is served at once next time);
one that nobody waits for any more and has not started is dropped.

Our cache, by spec hash, sits in front of xgrammar's: it shares a compile in flight between the requests that ask
for the same spec (each with its own deadline), keeps the mask a new sequence starts from, and holds grammars no
request uses up to GRAMMAR_CACHE_BYTES. xgrammar's own cache stays on, as it shares the pieces of different schemas
(the bench's 32 schemas compile 3.5x faster with it), but xgrammar 0.2.8's cache fails some compiles (a schema
pattern of `{1,300}` trips an internal check): a compile that fails with it is tried again without it.

xgrammar (and with it torch) and the tokenizer are loaded on a thread, on the first constrained request: a scheduler
that never sees one never loads them. The time limit counts from when they are loaded.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from base.structured_output import StructuredOutput
from scheduler.bad_words import bad_word_token_ids

GRAMMAR_CACHE_BYTES = 256 << 20    # compiled grammars kept when no request uses them, least recently used out first
FAILED_ENTRY_BYTES = 1 << 10       # what a cached compile error counts for


@dataclass
class CompiledConstraint:
    """A compiled grammar and the tokens it allows first (every new sequence under it starts from that mask)."""
    grammar: Any          # xgrammar.CompiledGrammar
    first_mask: Any       # numpy int32 bitmask row

    @property
    def nbytes(self) -> int:
        return self.grammar.memory_size_bytes + self.first_mask.nbytes


def spec_key(constraint: StructuredOutput) -> str:
    return hashlib.sha256(json.dumps([constraint.kind, constraint.spec, constraint.choices]).encode()).hexdigest()


@dataclass
class CacheEntry:
    future: Future
    waiters: int = 0      # requests that asked for it and have not taken their result yet
    size: int = 0         # bytes, once done and counted


@dataclass
class GrammarCache:
    """One compile per spec hash, shared by every request that asks for that spec while it runs or after."""
    max_bytes: int = GRAMMAR_CACHE_BYTES
    entries: OrderedDict[str, CacheEntry] = field(default_factory=OrderedDict)   # least recently used first
    num_bytes: int = 0
    num_compiles: int = 0
    uncounted: set[str] = field(default_factory=set)   # released while compiling: counted once done

    def acquire(self, key: str, start: Callable[[], Future]) -> Future:
        """The spec's compile, started now unless it is cached or running."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = CacheEntry(start())
            self.num_compiles += 1
        self.entries.move_to_end(key)
        entry.waiters += 1
        return entry.future

    def release(self, key: str) -> None:
        """A request took its result or gave up: a compile nobody waits for and not started yet is dropped."""
        entry = self.entries[key]
        entry.waiters -= 1
        if entry.waiters == 0 and entry.future.cancel():
            del self.entries[key]
        elif entry.waiters == 0 and not entry.size:
            self.uncounted.add(key)
        self.evict()

    def evict(self) -> None:
        """Count the compiles that ended unused, then drop unused ones, oldest use first, down to max_bytes."""
        for key in [k for k in self.uncounted if self.entries[k].future.done()]:
            self.uncounted.discard(key)
            self.entries[key].size = entry_size(self.entries[key].future)
            self.num_bytes += self.entries[key].size
        if self.num_bytes <= self.max_bytes:
            return
        for key in [k for k, e in self.entries.items() if e.waiters == 0 and e.size]:
            self.num_bytes -= self.entries.pop(key).size
            if self.num_bytes <= self.max_bytes:
                return


def entry_size(future: Future) -> int:
    return FAILED_ENTRY_BYTES if future.exception() is not None else future.result().nbytes


@dataclass
class GrammarCompilation:
    """xgrammar's compiler for one tokenizer, loaded on first use; compiles through the cache on a bounded pool."""
    model_path: str
    vocab_size: int
    stop_token_ids: list[int]
    num_workers: int = 2
    executor: ThreadPoolExecutor = field(init=False)
    loader: ThreadPoolExecutor = field(   # loads, then tokenizes bad words: never queued behind a compile
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="grammar-load"))
    cache: GrammarCache = field(default_factory=GrammarCache)
    lock: threading.Lock = field(default_factory=threading.Lock)
    loading: Future | None = None
    loaded_at: float | None = None        # time.monotonic() once xgrammar and the tokenizer are loaded
    compiler: Any = None
    uncached_compiler: Any = None
    tokenizer: Any = None
    no_control_chars: Any = None   # numpy int32 bitmask: the tokens without a byte below 0x20

    def __post_init__(self) -> None:
        self.executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="grammar-compile")

    def grammar(self, key: str, constraint: StructuredOutput) -> Future:
        """Future[CompiledConstraint] of the spec whose spec_key is key, shared with every request asking for it."""
        self.start_loading()
        return self.cache.acquire(key, lambda: self.executor.submit(self.compile, constraint))

    def bad_words(self, words: tuple[str, ...]) -> Future:
        """Future[list of each bad word's token ids]."""
        return self.loader.submit(self.tokenize_bad_words, words)

    def tokenize_bad_words(self, words: tuple[str, ...]) -> list[tuple[int, ...]]:
        self.get_compiler()
        return bad_word_token_ids(self.tokenizer, words)

    def start_loading(self) -> None:
        if self.loading is None:
            self.loading = self.loader.submit(self.get_compiler)

    def compile(self, constraint: StructuredOutput) -> CompiledConstraint:
        import xgrammar

        try:
            grammar = compile_spec(self.get_compiler(), constraint)
        except RuntimeError:   # a bad spec, or xgrammar's cache failing a good one
            grammar = compile_spec(self.uncached_compiler, constraint)
        return CompiledConstraint(grammar, next_token_mask(xgrammar.GrammarMatcher(grammar), self.vocab_size))

    def get_compiler(self) -> Any:
        with self.lock:
            if self.compiler is None:
                import xgrammar
                from transformers import AutoTokenizer

                self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                self.no_control_chars = control_char_free_bitmask(info.decoded_vocab, self.vocab_size)
                # one thread a compile: --structured-output-compile-workers compiles hold that many cores
                self.uncached_compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
                self.loaded_at = time.monotonic()
            return self.compiler

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.loader.shutdown(wait=False, cancel_futures=True)


def compile_spec(compiler: Any, constraint: StructuredOutput) -> Any:
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


def next_token_mask(matcher: Any, vocab_size: int) -> Any:
    """The matcher's allowed next tokens as a numpy int32 bitmask row (all allowed once it has terminated)."""
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab_size)
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(mask, 0)
    return mask.numpy()[0]


def control_char_free_bitmask(decoded_vocab: list[bytes], vocab_size: int) -> Any:
    import numpy

    allowed = numpy.zeros((vocab_size + 31) // 32 * 32, dtype=bool)
    allowed[:len(decoded_vocab)] = [min(token, default=0x20) >= 0x20 for token in decoded_vocab]
    return numpy.packbits(allowed, bitorder="little").view(numpy.int32)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are xgrammar's EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
