"""The default model, SmolLM2-135M-Instruct from its GGUF file, answers like a language model should."""
from __future__ import annotations

import pytest

from ferry import Engine, EngineConfig, SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_knows_the_capital_of_france(dtype):
    engine = Engine(EngineConfig(dtype=dtype, device="cpu", kv_cache_memory=1 << 27))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                  add_generation_prompt=True, tokenize=False)
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in result.text
