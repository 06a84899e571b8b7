"""Batched sampling: logit bias and masks (gpu_worker/sampling/logit_masks), penalties, greedy, temperature, top-k,
top-p, min-p, per-request seeds, logprobs; and prompt logprobs.

Runs on the logits' own device: on a GPU only the sampled ids (and any logprobs asked for) come back to the host.
Seeded rows draw from a generator on that device, so a seed gives one result on a GPU and another on a CPU."""
from __future__ import annotations

import torch
import xxhash

from base.sampling_params import SamplingParams
from gpu_worker.sampling.logit_masks import adjusts_logits, apply_adjustments
from gpu_worker.sampling.sample_row import SampleRow
from kernels import cpu_layers
from protos import common_pb2


def sample(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator, eos_token_ids: tuple[int, ...] = ()
           ) -> tuple[list[int], list[common_pb2.TokenLogprob | None]]:
    """logits [R, V] in the model's dtype, one row per sequence → one token id per row (+ logprobs where asked).
    Plain greedy rows take the argmax as they are; everything else is computed in float32."""
    adjusted = [r for r in rows if adjusts_logits(r)]
    if not adjusted and all(is_plain_greedy(r.params) for r in rows):
        return greedy_tokens(logits).tolist(), [None] * len(rows)
    logits = logits.float()
    if adjusted:
        apply_adjustments(logits, rows, eos_token_ids)
    apply_penalties(logits, rows)
    want_logprobs = [r.params.logprobs is not None for r in rows]
    logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        tokens[random_rows] = sample_random(logits[random_rows], [rows[i] for i in random_rows], generator)
    token_list = tokens.tolist()
    entries = [token_logprob(logprobs[i], token_list[i], rows[i].params.logprobs) if want else None
               for i, want in enumerate(want_logprobs)]
    return token_list, entries


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties). On the CPU in C++: torch's argmax over bf16 is slower than widening
    the logits to float32 first, and that alone costs ~2 ms a step at batch 64."""
    module = cpu_layers.extension() if logits.device.type == "cpu" else None
    if module is not None:
        return module.argmax_rows(logits)
    return logits.float().argmax(dim=-1)   # widening is exact: the same argmax


def is_plain_greedy(params: SamplingParams) -> bool:
    return (params.greedy and params.logprobs is None and params.repetition_penalty == 1.0
            and not params.presence_penalty and not params.frequency_penalty)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            output = row.token_ids[row.num_prompt_tokens:]
            if output:
                ids, counts = torch.tensor(output, dtype=torch.long, device=logits.device).unique(return_counts=True)
                logits[i, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty


def sample_random(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator) -> torch.Tensor:
    temperature = row_values([r.params.temperature for r in rows], logits).unsqueeze(1)
    logits = logits / temperature
    logits = mask_top_k_top_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = row_values([r.params.min_p for r in rows], probs).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; seeded rows get their own noise.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, row in enumerate(rows):
        if row.params.seed is not None:
            noise[i].exponential_(generator=seeded_generator(row, noise.device))
    return (probs / noise).argmax(dim=-1)


def row_values(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """One value per row, as a tensor of like's dtype on like's device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def mask_top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab_size = logits.shape[1]
    top_ks = [r.params.top_k if 0 < r.params.top_k < vocab_size else vocab_size for r in rows]
    if all(k == vocab_size for k in top_ks) and all(r.params.top_p >= 1.0 for r in rows):
        return logits
    top_k = torch.tensor(top_ks, device=logits.device)
    top_p = row_values([r.params.top_p for r in rows], logits)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p.unsqueeze(1)
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def seeded_generator(row: SampleRow, device: torch.device) -> torch.Generator:
    # Depends only on (seed, sample, position): batching and preemption never change a seeded result.
    key = f"{row.params.seed}:{row.sample_index}:{len(row.token_ids)}".encode()
    return torch.Generator(device=device).manual_seed(xxhash.xxh64_intdigest(key) & ((1 << 63) - 1))


def token_logprob(logprobs: torch.Tensor, token_id: int, top: int) -> common_pb2.TokenLogprob:
    entry = common_pb2.TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]))
    if top:
        values, ids = logprobs.topk(top)
        entry.top.extend(common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(ids.tolist(), values.tolist()))
    return entry


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[common_pb2.TokenLogprob]:
    """Row i of logits scores targets[i]: its logprob and row i's top `top`, from the raw logits (no sampling
    parameter applies to a prompt, as in vLLM)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1))
    chosen = chosen.squeeze(1).tolist()
    entries = [common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in zip(targets, chosen)]
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        for entry, row_ids, row_values in zip(entries, ids.tolist(), values.tolist()):
            entry.top.extend(common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(row_ids, row_values))
    return entries
