"""Sampling behaviour a user relies on: greedy is argmax, seeds repeat, filters and penalties do their job; on a
GPU (where there is one) it picks what it picks on the CPU wherever no random draw decides."""
from __future__ import annotations

import pytest
import torch

from base.sampling_params import SamplingParams
from gpu_worker.sampling.sampler import SampleRow, sample

VOCAB = 50
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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


WIDE_VOCAB = 1000   # not a multiple of 32: the last bitmask word is partly past the vocabulary


def rows_of(params: list[SamplingParams], bitmask: bytes | None = None) -> list[SampleRow]:
    return [SampleRow(p, [1, 2, 3, 5, 5, 9], 3, 0, bitmask if i == 0 else None) for i, p in enumerate(params)]


@pytest.mark.parametrize("device", DEVICES)
def test_on_any_device_the_sampler_picks_what_it_picks_on_the_cpu_wherever_no_random_draw_decides(device) -> None:
    logits = torch.randn(5, WIDE_VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    allowed = torch.zeros(-(-WIDE_VOCAB // 32), dtype=torch.int32)
    allowed[3] = 0b1010   # the grammar allows tokens 97 and 99 only
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0, logit_bias={7: 50.0}, logprobs=5),
              SamplingParams(temperature=0, min_tokens=10, stop_token_ids=[int(logits[3].argmax())]),
              SamplingParams(temperature=0.7, top_k=1)]
    rows = rows_of(params, allowed.numpy().tobytes())
    on_cpu = sample(logits.clone(), rows, torch.Generator().manual_seed(0), eos_token_ids=(2,))
    on_gpu = sample(logits.to(device), rows, torch.Generator(device=device).manual_seed(0), eos_token_ids=(2,))
    assert on_gpu[0] == on_cpu[0] and on_cpu[0][0] in (97, 99) and on_cpu[0][2] == 7
    cpu_entry, gpu_entry = on_cpu[1][2], on_gpu[1][2]
    assert [t.token_id for t in gpu_entry.top] == [t.token_id for t in cpu_entry.top]
    assert gpu_entry.logprob == pytest.approx(cpu_entry.logprob, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_on_any_device_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch(device) -> None:
    logits = torch.randn(4, WIDE_VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = sample(logits[:1].clone(), rows_of([seeded]), torch.Generator(device=device).manual_seed(0))[0]
    batched = sample(logits.clone(), rows_of([seeded] + [SamplingParams(temperature=1.0)] * 3),
                     torch.Generator(device=device).manual_seed(5))[0]
    assert alone[0] == batched[0]
