"""What the in-process engine tests share: an engine over the tiny model on the CPU, its KV pool sized in blocks,
random prompts in its vocabulary, and the same model in transformers to compare against."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferry import Engine, EngineConfig

BLOCK_SIZE = 4


def tiny_engine(model_dir, **overrides) -> Engine:
    config = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                  kv_cache_memory=1 << 22, max_model_len=256)
    config.update(overrides)
    return Engine(EngineConfig(**config))


def kv_bytes_for(model_dir, num_blocks: int) -> int:
    # the tiny model: 2 layers, 2 KV heads of 16 dims, float32
    return num_blocks * 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


def random_prompts(seed: int, count: int, lengths: range) -> list[list[int]]:
    """count prompts of ids in the tiny vocabulary, each one's length drawn from lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(lengths.start, lengths.stop))] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
