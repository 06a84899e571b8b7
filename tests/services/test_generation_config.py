"""The model's sampling defaults through a real stack (--generation-config auto, vLLM's default): a request that
leaves temperature unset samples at the model's (here 0: greedy, token-exact against transformers), and the model's
max_new_tokens caps every request's max_tokens."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.openai_fixtures import Reference
from tests.services_fixtures import start_http_stack

PROMPT = "Paris is the capital of"
CAP = 5


@pytest.fixture(scope="module")
def greedy_model_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("greedy-by-default") / "tiny-greedy"
    shutil.copytree(tiny_llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": CAP}))
    return path


def test_unset_fields_take_the_models_defaults_and_its_max_new_tokens_caps_max_tokens(greedy_model_dir):
    reference = Reference(greedy_model_dir)
    want, _ = reference.greedy(reference.encode(PROMPT), CAP)
    with start_http_stack(greedy_model_dir) as stack:
        client = stack.client()
        unset = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=12, seed=1)
        sampled = [client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                             seed=seed) for seed in range(4)]
    assert unset.choices[0].text == reference.decode(want) and unset.usage.completion_tokens == len(want)
    assert all(r.usage.completion_tokens <= CAP for r in sampled)
    assert any(r.choices[0].text != unset.choices[0].text for r in sampled)   # its own temperature was kept
