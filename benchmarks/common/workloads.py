"""Benchmark workloads: JSON lists of {"prompt_token_ids": [...], "max_tokens": N} (greedy, ignore_eos)."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from benchmarks.common.bench_request import BenchRequest
from benchmarks.common.routing_workloads import GENERATORS

SHARED_WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "workloads"   # ../shared beside the checkout
CHAT_QUESTIONS = [
    "What is the capital of France?", "Explain continuous batching in one paragraph.",
    "Write a haiku about ships.", "How does paged attention save memory?", "Name three prime numbers.",
    "What is a KV cache?", "Summarise the plot of Hamlet.", "Give me a recipe for pancakes.",
]


ROUTING_WORKLOADS = tuple(GENERATORS)   # generated at any length: see benchmarks/common/routing_workloads.py


def load_workload_file(path: Path) -> list[BenchRequest]:
    items = json.loads(Path(path).read_text())
    return [BenchRequest(list(item["prompt_token_ids"]), int(item["max_tokens"])) for item in items]


def generate(name: str, num_requests: int = 64, seed: int = 0, vocab: tuple[int, int] = (1000, 40000)
             ) -> list[BenchRequest]:
    """Deterministic stand-ins of the reference shapes, for when ../shared/workloads is not there."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(*vocab) for _ in range(n)]  # noqa: E731
    if name == "mixed":
        return [BenchRequest(ids(rng.randint(32, 256)), rng.randint(40, 511)) for _ in range(num_requests)]
    if name == "mixed_small":
        return [BenchRequest(ids(rng.randint(37, 128)), rng.randint(20, 126)) for _ in range(num_requests)]
    if name == "shared_prefix":
        prefix = ids(512)
        return [BenchRequest(prefix + ids(rng.randint(16, 64)), rng.randint(34, 128)) for _ in range(num_requests)]
    if name == "sharegpt_shaped":
        return sharegpt_shaped(rng, ids, num_requests)
    raise ValueError(f"unknown workload {name!r}")


def sharegpt_shaped(rng: random.Random, ids, num_requests: int) -> list[BenchRequest]:
    """Log-normal lengths (sigma 1.0) with ShareGPT's means (161 prompt, 338 output tokens: the vLLM paper), clipped
    to [8, 1024] and [8, 1536], as ../shared/workloads/sharegpt_shaped.json was drawn (with numpy there)."""
    def length(mean: float, high: int) -> int:
        return min(high, max(8, round(rng.lognormvariate(math.log(mean) - 0.5, 1.0))))
    return [BenchRequest(ids(length(161, 1024)), length(338, 1536)) for _ in range(num_requests)]


def load(name: str, tokenizer=None, num_requests: int | None = None) -> list[BenchRequest]:
    if name == "chat":
        return chat_workload(tokenizer, num_requests or 32)
    if name in GENERATORS:
        return GENERATORS[name](num_requests or 512)
    shared = SHARED_WORKLOADS / f"{name}.json"
    requests = load_workload_file(shared) if shared.is_file() else generate(name)
    if num_requests and num_requests > len(requests):
        return extend(requests, num_requests)
    return requests[:num_requests] if num_requests else requests


def extend(requests: list[BenchRequest], num_requests: int, vocab: tuple[int, int] = (1000, 40000)
           ) -> list[BenchRequest]:
    """More requests of the same shape: copy k shifts every token id by k positions of the vocabulary range, so
    no copy shares a prefix with another and the prefix cache cannot flatter the longer workload."""
    low, span = vocab[0], vocab[1] - vocab[0]
    out = []
    for i in range(num_requests):
        base, copy = requests[i % len(requests)], i // len(requests)
        ids = [low + (t - low + 7919 * copy) % span for t in base.prompt_token_ids]
        out.append(BenchRequest(ids, base.max_tokens))
    return out


def chat_workload(tokenizer, num_requests: int) -> list[BenchRequest]:
    if tokenizer is None:
        raise ValueError("the chat workload needs the model's tokenizer")
    requests = []
    for i in range(num_requests):
        text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}],
                                             add_generation_prompt=True, tokenize=False)
        requests.append(BenchRequest(tokenizer(text, add_special_tokens=False).input_ids, 128))
    return requests
