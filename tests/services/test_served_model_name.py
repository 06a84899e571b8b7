"""--served-model-name (vLLM's flag): the model's names in the API. Requests may give any of them, responses and
the model list name the first, and the model directory's name is no longer one of them."""
from __future__ import annotations

import pytest

from tests.services_fixtures import start_http_stack


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with start_http_stack(tiny_llama_dir, **{"--served-model-name": ("tiny-chat", "tiny-alias")}) as http_stack:
        yield http_stack


def test_the_models_list_gives_the_served_names(stack):
    assert sorted(m.id for m in stack.client().models.list().data) == ["tiny-alias", "tiny-chat"]


@pytest.mark.parametrize("name", ["tiny-chat", "tiny-alias"])
def test_a_request_may_name_the_model_by_any_of_its_names_and_is_answered_by_the_first(stack, name):
    result = stack.client().completions.create(model=name, prompt="Paris is", max_tokens=4, temperature=0)
    assert result.model == "tiny-chat" and result.usage.completion_tokens == 4
    chat = stack.client().chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, temperature=0)
    assert chat.model == "tiny-chat"


def test_the_directorys_name_is_not_a_model_any_more(stack, tiny_llama_dir):
    response = stack.post("/completions", {"model": tiny_llama_dir.name, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 404
    assert "tiny-chat" in response.text and "tiny-alias" in response.text
