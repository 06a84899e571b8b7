"""`ferry bench grammar-engines`: xgrammar (what Ferry uses) against llguidance on the default model's tokenizer:
the time to compile a new JSON schema, and the time to fill the token bitmask of 32 rows, each under its own schema,
per decode step (the rows advance by random allowed tokens, seeded). llguidance is not a dependency of Ferry: install
it beside it (`pip install llguidance`), then `ferry bench grammar-engines`.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common.cli_args import bench_parser
from benchmarks.engine.structured import row_schema

BATCH, STEPS = 32, 40


def allowed_tokens(mask_row, vocab_size: int) -> list[int]:
    words = mask_row.numpy().view("uint32")
    return [w * 32 + b for w, word in enumerate(words) if word for b in range(32)
            if word >> b & 1 and w * 32 + b < vocab_size]


def run(name: str, vocab_size: int, make_matchers: Callable[[], list[Any]], fill: Callable[[list[Any]], Any],
        consume: Callable[[Any, int], None]) -> None:
    start = time.perf_counter()
    matchers = make_matchers()
    compile_s = time.perf_counter() - start
    rng, times = random.Random(0), []
    for _ in range(STEPS):
        start = time.perf_counter()
        mask = fill(matchers)
        times.append(time.perf_counter() - start)
        for row, matcher in enumerate(matchers):
            if tokens := allowed_tokens(mask[row], vocab_size):
                consume(matcher, rng.choice(tokens))
    ms = sorted(t * 1e3 for t in times)
    print(f"| {name} | {compile_s / BATCH * 1e3:.1f} | {statistics.mean(ms):.2f} | {statistics.median(ms):.2f} | "
          f"{ms[int(0.9 * len(ms))]:.2f} |")


def xgrammar_rows(tokenizer, vocab_size: int) -> None:
    import xgrammar

    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))

    def fill(matchers: list[Any]):
        mask = xgrammar.allocate_token_bitmask(BATCH, vocab_size)
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, row)
        return mask

    run("xgrammar", vocab_size,
        lambda: [xgrammar.GrammarMatcher(compiler.compile_json_schema(row_schema(i))) for i in range(BATCH)],
        fill, lambda matcher, token: matcher.accept_token(token))


def llguidance_rows(tokenizer, vocab_size: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    wrapped = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def fill(matchers: list[Any]):
        mask = llguidance.torch.allocate_token_bitmask(BATCH, vocab_size)
        for row, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, mask, row)
        return mask

    run("llguidance", vocab_size,
        lambda: [llguidance.LLMatcher(wrapped, llguidance.LLMatcher.grammar_from_json_schema(row_schema(i)))
                 for i in range(BATCH)],
        fill, lambda matcher, token: matcher.consume_token(token))


def main(argv: list[str]) -> int:
    bench_parser("grammar-engines", __doc__).parse_args(argv)
    from transformers import AutoTokenizer

    from gpu_worker.loading.model_files import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    print(f"| engine | compile ms a schema | batch-{BATCH} mask ms: mean | median | p90 |\n|---|---:|---:|---:|---:|")
    for _ in range(2):   # alternately, so that machine noise falls on both
        xgrammar_rows(tokenizer, len(tokenizer))
        llguidance_rows(tokenizer, len(tokenizer))
    return 0
