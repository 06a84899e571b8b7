"""Workloads where routing matters, generated deterministically from a seed (numpy's default_rng).

- `tenants`: T tenants, each with its own long system prompt / document (512-2,048 tokens); tenant popularity is
  Zipf (s ~ 1.1: tenant k is picked with weight 1 / k^s); each request = its tenant's prefix + a short question.
- `multiturn`: conversations of 3-8 turns; each turn's prompt is the previous turn's prompt + its answer + a new
  question; several sessions are open at once and their turns are interleaved (turn order within a session kept).
  The answer tokens are the workload's own (a served model writes different ones), so what a later turn can find
  cached is its previous prompt, not the previous answer.

And over any workload, the LoRA adapter each request names (`adapter_picks`): one of A adapters, drawn independently
of the prompt, Zipf-popular (s = 1.1 by default; 0: uniform).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.common.bench_request import BenchRequest

VOCAB = (1000, 40000)


@dataclass(frozen=True)
class TenantsShape:
    num_tenants: int = 32
    prefix_tokens: tuple[int, int] = (512, 2048)      # inclusive range of a tenant's prefix length
    question_tokens: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (32, 128)
    zipf_s: float = 1.1


@dataclass(frozen=True)
class MultiturnShape:
    turns: tuple[int, int] = (3, 8)
    first_prompt_tokens: tuple[int, int] = (64, 256)
    question_tokens: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (32, 128)
    open_sessions: int = 16                            # sessions whose turns are interleaved at any moment


def token_ids(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(*VOCAB, size=length).tolist()


def length_in(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def zipf_weights(num_items: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, num_items + 1) ** s
    return weights / weights.sum()


def tenants(num_requests: int = 512, seed: int = 0, shape: TenantsShape = TenantsShape()) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    prefixes = [token_ids(rng, length_in(rng, shape.prefix_tokens)) for _ in range(shape.num_tenants)]
    picks = rng.choice(shape.num_tenants, size=num_requests, p=zipf_weights(shape.num_tenants, shape.zipf_s))
    return [BenchRequest(prefixes[t] + token_ids(rng, length_in(rng, shape.question_tokens)),
                         length_in(rng, shape.max_tokens)) for t in picks]


@dataclass
class Conversation:
    turns_left: int
    prompt: list[int]
    answer_tokens: int


def new_conversation(rng: np.random.Generator, shape: MultiturnShape) -> Conversation:
    return Conversation(length_in(rng, shape.turns), token_ids(rng, length_in(rng, shape.first_prompt_tokens)),
                        length_in(rng, shape.max_tokens))


def next_turn(rng: np.random.Generator, shape: MultiturnShape, talk: Conversation) -> None:
    """The next prompt: the previous prompt, its answer, a new question."""
    answer = token_ids(rng, talk.answer_tokens)
    talk.prompt = talk.prompt + answer + token_ids(rng, length_in(rng, shape.question_tokens))
    talk.answer_tokens = length_in(rng, shape.max_tokens)
    talk.turns_left -= 1


def multiturn(num_requests: int = 512, seed: int = 0, shape: MultiturnShape = MultiturnShape()) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    open_talks = [new_conversation(rng, shape) for _ in range(shape.open_sessions)]
    requests = []
    while len(requests) < num_requests:
        slot = int(rng.integers(len(open_talks)))
        talk = open_talks[slot]
        requests.append(BenchRequest(list(talk.prompt), talk.answer_tokens))
        next_turn(rng, shape, talk)
        if talk.turns_left == 0:
            open_talks[slot] = new_conversation(rng, shape)
    return requests


GENERATORS = {"tenants": tenants, "multiturn": multiturn}


def adapter_names(num_adapters: int) -> list[str]:
    return [f"lora-{k:03d}" for k in range(num_adapters)]


def adapter_picks(num_requests: int, num_adapters: int, zipf_s: float = 1.1, seed: int = 0) -> list[str]:
    """The adapter each request names: adapter k picked with weight 1 / (k + 1)^zipf_s, from a stream of its own
    (the prompts drawn from the same seed are the same with or without adapters)."""
    rng = np.random.default_rng([seed, num_adapters])
    names = adapter_names(num_adapters)
    return [names[k] for k in rng.choice(num_adapters, size=num_requests, p=zipf_weights(num_adapters, zipf_s))]
