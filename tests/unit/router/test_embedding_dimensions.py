"""/v1/embeddings' `dimensions` (router/http/embeddings.py): a Matryoshka-trained model's embedding cut to its first
numbers and normalized again, as vLLM answers it; a model whose config.json does not say it was trained so, or a
size it was not trained at, is refused naming the field before any scheduler is asked."""
from __future__ import annotations

import json
import shutil

import numpy
import pytest
from fastapi.testclient import TestClient

from protos import common_pb2, router_pb2
from router.http.app import create_app
from router.http.served_models import ServedModel
from router.tokenizer import RouterTokenizer

HIDDEN = [0.5, -0.5, 0.1, 0.7, 0.0, 0.2, -0.1, 0.3]
WHOLE = (numpy.array(HIDDEN) / numpy.linalg.norm(HIDDEN)).tolist()   # what the scheduler sends: normalized


def app_for(tokenizer_dir, tmp_path, **config) -> tuple[TestClient, list]:
    model_dir = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": len(HIDDEN), **config}))
    asked = []

    async def generate(request, **_):
        asked.append(request)
        yield router_pb2.GenerateResponse(index=0, embedding=WHOLE, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                          usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=1))

    model = ServedModel("tiny", "", RouterTokenizer(str(model_dir)), max_model_len=64, model_path=str(model_dir))
    return TestClient(create_app(generate, models=lambda: [model])), asked


@pytest.mark.parametrize("config", [{"is_matryoshka": True}, {"matryoshka_dimensions": [4, 8]}])
def test_a_matryoshka_model_gives_the_first_numbers_normalized_again(tokenizer_dir, tmp_path, config):
    client, _ = app_for(tokenizer_dir, tmp_path, **config)
    response = client.post("/v1/embeddings", json={"input": ["a", "b"], "dimensions": 4})
    assert response.status_code == 200, response.text
    want = numpy.array(HIDDEN[:4]) / numpy.linalg.norm(HIDDEN[:4])
    for item in response.json()["data"]:
        assert item["embedding"] == pytest.approx(want.tolist(), abs=1e-6)
    whole = client.post("/v1/embeddings", json={"input": "a"}).json()["data"][0]["embedding"]
    assert whole == pytest.approx(WHOLE)


@pytest.mark.parametrize("config, dimensions, words", [
    ({}, 4, ["does not support matryoshka"]),
    ({"is_matryoshka": False}, 4, ["does not support matryoshka"]),
    ({"matryoshka_dimensions": [4, 8]}, 6, ["[4, 8]"]),
    ({"is_matryoshka": True}, 9, ["at most", "8"]),
    ({"is_matryoshka": True}, 0, ["at least 1"]),
])
def test_dimensions_a_model_was_not_trained_at_are_400_naming_the_field(tokenizer_dir, tmp_path, config,
                                                                        dimensions, words):
    client, asked = app_for(tokenizer_dir, tmp_path, **config)
    response = client.post("/v1/embeddings", json={"input": "a", "dimensions": dimensions})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "dimensions" and all(word in error["message"] for word in words)
    assert not asked
