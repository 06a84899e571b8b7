"""Sampling behaviour a user relies on: greedy is argmax, seeds repeat, filters and penalties do their job."""
from __future__ import annotations

import torch

from base.sampling_params import SamplingParams
from gpu_worker.sampler import SampleRow, sample

VOCAB = 50


def logits_rows(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(history=(1, 2, 3), prompt_len=3, index=0, **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), list(history), prompt_len, index)


def draw(logits, rows, seed=0):
    return sample(logits.clone(), rows, torch.Generator().manual_seed(seed))


def test_greedy_and_top_k_1_and_tiny_top_p_are_argmax():
    logits = logits_rows(3)
    tokens, _ = draw(logits, [row(temperature=0), row(temperature=1.0, top_k=1), row(temperature=1.0, top_p=1e-6)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch_neighbours():
    logits = logits_rows(4)
    seeded = [row(temperature=1.0, seed=42) for _ in range(4)]
    alone = [draw(logits[i:i + 1], [seeded[i]], seed=i)[0][0] for i in range(4)]
    together, _ = draw(logits, seeded, seed=99)
    assert together == alone
    different_seed, _ = draw(logits, [row(temperature=1.0, seed=43) for _ in range(4)])
    many = [draw(logits_rows(1, s), [row(temperature=1.0, seed=s)])[0][0] for s in range(20)]
    assert len(set(many)) > 1 and (different_seed != together or len(set(many)) > 1)


def test_top_k_limits_the_choices():
    logits = logits_rows(1)
    allowed = set(logits[0].topk(3).indices.tolist())
    seen = {draw(logits, [row(temperature=2.0, top_k=3)], seed=s)[0][0] for s in range(60)}
    assert seen <= allowed and len(seen) > 1


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 7], logits[0, 9] = 5.0, 4.5
    seen = {draw(logits, [row(temperature=1.0, min_p=0.1)], seed=s)[0][0] for s in range(40)}
    assert seen == {7, 9}


def test_penalties_push_away_repeated_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    assert draw(logits, [row(history=(1, 5, 5), prompt_len=1, temperature=0, frequency_penalty=0.2)])[0] == [6]
    assert draw(logits, [row(history=(1, 5), prompt_len=1, temperature=0, presence_penalty=0.5)])[0] == [6]
    assert draw(logits, [row(history=(5,), prompt_len=1, temperature=0, repetition_penalty=2.0)])[0] == [6]
    assert draw(logits, [row(history=(5,), prompt_len=1, temperature=0)])[0] == [5]


def test_logprobs_are_log_softmax_values_with_top_alternatives():
    logits = logits_rows(2)
    tokens, entries = draw(logits, [row(temperature=0, logprobs=3), row(temperature=0)])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert abs(entries[0].logprob - float(expected[tokens[0]])) < 1e-5
    assert [t.token_id for t in entries[0].top] == expected.topk(3).indices.tolist()
    assert entries[1] is None


def test_bfloat16_logits_sample_as_their_float32_values():
    logits = logits_rows(4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 30] = logits[0].max() + 1   # a tie: the first index wins, as in float32
    widened = logits.float()
    greedy, none = draw(logits, [row(temperature=0) for _ in range(4)])
    assert greedy == widened.argmax(dim=-1).tolist() and greedy[0] == 7 and none == [None] * 4
    mixed = [row(temperature=0, logprobs=2), row(temperature=0, repetition_penalty=1.3), row(temperature=0.8, seed=5),
             row(temperature=0)]
    assert draw(logits, mixed) == draw(widened, mixed)
