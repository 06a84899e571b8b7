"""A prompt's embedding (SamplingParams.return_embedding, what /v1/embeddings asks for): its last position's final
hidden state, L2-normalized, equal to transformers' in float32 whether the prompt is computed in one step, in
chunks, after a prefix-cache hit, or on two tensor-parallel ranks; a request that does not ask gets none."""
from __future__ import annotations

import pytest
import torch

from ferry import SamplingParams
from tests.model_families_fixtures import build_tiny_model, prompts, tiny_engine

__all__ = ["prompts"]   # the shared fixture
EMBED = SamplingParams(max_tokens=1, temperature=0, return_embedding=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


def transformers_embeddings(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.nn.functional.normalize(model.model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                for p in prompts]


@pytest.mark.parametrize("engine_config", [{}, {"max_num_batched_tokens": 8}, {"tensor_parallel_size": 2}],
                         ids=["one step", "chunked", "two ranks"])
def test_embeddings_are_transformers_last_hidden_state_normalized(qwen3, prompts, engine_config):
    model_dir, model = qwen3
    engine = tiny_engine(model_dir, **engine_config)
    expected = transformers_embeddings(model, prompts)
    for _ in range(2):   # the second time, the shared prefix is a cache hit
        results = engine.generate(prompts, EMBED)
        for result, want in zip(results, expected):
            assert torch.allclose(torch.tensor(result.embedding), want, atol=1e-5)
    assert engine.stats().prefix_cache_hits > 0
    assert engine.generate(prompts[:1], SamplingParams(max_tokens=1))[0].embedding is None


def test_a_checkpoint_of_the_base_model_alone_embeds_as_transformers(qwen3, tmp_path, prompts):
    """Qwen3-Embedding's form: a Qwen3Model saved without the "model." prefix or an LM head."""
    from transformers import Qwen3Model

    model_dir, model = qwen3
    base = Qwen3Model(model.config).eval()
    base.load_state_dict(model.model.state_dict())
    base.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    results = tiny_engine(tmp_path).generate(prompts, EMBED)
    for result, want in zip(results, transformers_embeddings(model, prompts)):
        assert torch.allclose(torch.tensor(result.embedding), want, atol=1e-5)
