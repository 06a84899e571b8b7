"""Batched sampling: logit bias and masks (gpu_worker/sampling/logit_masks), penalties, greedy, temperature, top-k,
top-p, min-p, per-request seeds, logprobs; and prompt logprobs.

Runs on the logits' own device: on a GPU only the sampled ids (and any logprobs asked for) come back to the host.
Seeded rows draw from a generator on that device, so a seed gives one result on a GPU and another on a CPU."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import xxhash

from base.sampling_params import SamplingParams
from gpu_worker.sampling.logit_masks import adjusts_logits, apply_adjustments
from gpu_worker.sampling.sample_row import SampleRow
from kernels import cpu_layers
from kernels.staging import tensor_on
from protos import common_pb2


def sample(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator, eos_token_ids: tuple[int, ...] = ()
           ) -> tuple[list[int], list[common_pb2.TokenLogprob | None]]:
    """logits [R, V] in the model's dtype, one row per sequence → one token id per row (+ logprobs where asked)."""
    return sample_on_device(logits, rows, generator, eos_token_ids).to_host()


def sample_on_device(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator,
                     eos_token_ids: tuple[int, ...] = ()) -> Sampled:
    """The ids (and logprobs) on the logits' device, nothing read back: a launched step's forward may follow.
    Plain greedy rows take the argmax as they are; everything else is computed in float32."""
    adjusted = [r for r in rows if adjusts_logits(r)]
    if not adjusted and all(is_plain_greedy(r.params) for r in rows):
        return Sampled.of(greedy_tokens(logits), None, [None] * len(rows))
    logits = logits.float()
    if adjusted:
        apply_adjustments(logits, rows, eos_token_ids)
    apply_penalties(logits, rows)
    tops = [r.params.logprobs for r in rows]
    logprobs = torch.log_softmax(logits, dim=-1) if any(top is not None for top in tops) else None
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        index = tensor_on(random_rows, torch.long, logits.device)
        tokens[index] = sample_random(logits[index], [rows[i] for i in random_rows], generator)
    return Sampled.of(tokens, logprobs, tops)


@dataclass
class Sampled:
    """A step's sampled ids on the device, on their way to the host; to_host() waits for them."""
    tokens: torch.Tensor                 # [R] int64, on the logits' device
    logprobs: torch.Tensor | None        # [R, V] float32, where some row asked for logprobs
    tops: list[int | None]               # each row's top-n logprobs asked (None: no logprobs)
    host: torch.Tensor | None = None     # the ids' copy in host memory (on a GPU: pinned, filled when `copied`)
    copied: object = None                # on a GPU: the event recorded after that copy

    @classmethod
    def of(cls, tokens: torch.Tensor, logprobs: torch.Tensor | None, tops: list[int | None]) -> Sampled:
        sampled = cls(tokens, logprobs, tops, host=tokens)
        if tokens.device.type == "cuda":
            sampled.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            sampled.host.copy_(tokens, non_blocking=True)
            sampled.copied = torch.cuda.Event()
            sampled.copied.record()
        return sampled

    def ready(self) -> bool:
        """Whether to_host() would return without waiting for the device."""
        return self.copied is None or self.copied.query()

    def to_host(self) -> tuple[list[int], list[common_pb2.TokenLogprob | None]]:
        if self.copied is not None:
            self.copied.synchronize()
        token_list = self.host.tolist()
        return token_list, [None if top is None else token_logprob(self.logprobs[i], token_list[i], top)
                            for i, top in enumerate(self.tops)]


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
            seen = tensor_on(sorted(set(row.token_ids)), torch.long, logits.device)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            output = row.token_ids[row.num_prompt_tokens:]
            if output:   # counted on the host: unique() on a GPU waits for it to know its output's size
                counts = Counter(output)
                ids = tensor_on(list(counts), torch.long, logits.device)
                times = tensor_on(list(counts.values()), logits.dtype, logits.device)
                logits[i, ids] -= p.frequency_penalty * times + p.presence_penalty


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
    return tensor_on(values, like.dtype, like.device)


def mask_top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab_size = logits.shape[1]
    top_ks = [r.params.top_k if 0 < r.params.top_k < vocab_size else vocab_size for r in rows]
    if all(k == vocab_size for k in top_ks) and all(r.params.top_p >= 1.0 for r in rows):
        return logits
    top_k = tensor_on(top_ks, torch.long, logits.device)
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
