"""Greedy continuations from Ferry and from transformers on the same prompts and device, compared token by token."""
from __future__ import annotations

import gc
import random

import torch

from ferry import Engine, EngineConfig, SamplingParams


def transformers_greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """transformers `generate`'s greedy continuation of each prompt alone, exactly num_tokens long: the reference
    Ferry's batched outputs must equal token for token."""
    outputs = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def ferry_greedy(model_dir: str, dtype: torch.dtype, device: str, prompts: list[list[int]], num_tokens: int,
                 kv_cache_memory: int = 1 << 30) -> list[list[int]]:
    """The same continuations from Ferry's engine, all prompts in one batch (min_tokens holds EOS back, as
    transformers' min_new_tokens does)."""
    engine = Engine(EngineConfig(model=model_dir, dtype=str(dtype).removeprefix("torch."), device=device,
                                 kv_cache_memory=kv_cache_memory))
    params = SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens)
    outputs = {f"p{i}": [] for i in range(len(prompts))}
    for request_id, prompt in zip(outputs, prompts):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return list(outputs.values())


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    """The first position where the two differ (None: identical)."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                None if len(ours) == len(reference) else min(len(ours), len(reference)))


def random_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(5, 40))] for _ in range(count)]


def first_divergences(model_dir: str, dtype: torch.dtype, device: str, num_prompts: int, num_tokens: int
                      ) -> list[int | None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    prompts = random_prompts(num_prompts, model.config.vocab_size)
    with torch.inference_mode():
        reference = transformers_greedy(model, prompts, num_tokens)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()   # the engine sizes nothing from free memory here, but keeps the device clean
    ours = ferry_greedy(model_dir, dtype, device, prompts, num_tokens)
    return [first_divergence(a, b) for a, b in zip(ours, reference)]
