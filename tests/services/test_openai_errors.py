"""The OpenAI-compatible HTTP API's refusals on a real router: bad input is 400 naming the problem, an unknown model
404, a wrong or missing API key 401 (over gRPC too); a client that hangs up aborts its request."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.openai_fixtures import stack
from tests.services_fixtures import API_KEY, wait_until

__all__ = ["stack"]   # the shared fixture

LONG = 600      # tokens a request would take to finish on its own


# --- errors, over raw HTTP ---------------------------------------------------------------------------------
def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize("path, body, words, param", [
    ("/completions", b"{not json", ["JSON"], None),
    ("/completions", {"max_tokens": 4}, ["prompt", "required"], "prompt"),
    ("/chat/completions", {"max_tokens": 4}, ["messages", "required"], "messages"),
    ("/chat/completions", {"messages": []}, ["messages"], "messages"),
    ("/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, ["role"], "messages"),
    ("/completions", {"prompt": "hi", "temperature": "hot"}, ["temperature"], "temperature"),
    ("/completions", {"prompt": "hi", "max_tokens": -1}, ["max_tokens"], "max_tokens"),
    ("/completions", {"prompt": "hi", "max_tokens": 0}, ["max_tokens"], None),
    ("/completions", {"prompt": "hi", "top_p": 1.5}, ["top_p"], None),
    ("/completions", {"prompt": "hi", "n": 0}, ["n must be"], None),
    ("/completions", {"prompt": "hi", "logprobs": 50}, ["logprobs"], "logprobs"),
    ("/completions", {"prompt": "hi", "stop": [""]}, ["stop"], None),
    ("/completions", {"prompt": "hello " * 1200, "max_tokens": 8}, ["max_model_len"], None),
    ("/completions", {"prompt": [1, 2, 100000]}, ["token ids"], None),
    ("/completions", {"prompt": ""}, ["prompt must not be empty"], None),
    ("/completions", {"prompt": ["a"] * 257}, ["batch", "256"], "prompt"),
    ("/completions", {"prompt": ["a", "b"], "suffix": "x"}, ["suffix"], "suffix"),
    ("/completions", {"prompt": [[1, 2], [3, 100000]]}, ["token ids"], None),   # one bad prompt refuses the batch
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, ["logprobs"],
     "top_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}], "max_tokens": 2},
     ["text content"], "messages[0].content"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     ["json_schema"], "response_format"),
    ("/completions", {"prompt": "hi", "logit_bias": {"fifty": 10}}, ["logit_bias"], "logit_bias"),
    ("/completions", {"prompt": "hi", "suffix": "x"}, ["fill-in-the-middle"], "suffix"),
    ("/completions", {"prompt": "hi", "cache_salt": ""}, ["cache_salt"], "cache_salt"),
    ("/embeddings", {"input": []}, ["input"], "input"),
    ("/embeddings", {"input": "hi", "encoding_format": "hex"}, ["encoding_format"], "encoding_format"),
    ("/embeddings", {"input": "hi", "dimensions": 8}, ["dimensions"], "dimensions"),
    ("/embeddings", {"input": [1, 2, 100000]}, ["token ids"], None),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, ["text_1"], "text_1"),
    ("/rerank", {"query": "a", "documents": []}, ["documents"], "documents"),
    ("/completions", {"prompt": "hi", "cache_salt": "s" * 1025}, ["cache_salt", "1024"], "cache_salt"),
    ("/responses", {"input": []}, ["input"], "input"),
    ("/responses", {"input": "hi", "previous_response_id": "resp_1"}, ["not stored"], "previous_response_id"),
    ("/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, ["function tools"], "tools[0]"),
    ("/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, ["text content"],
     "input[0].content"),
    ("/responses", {"input": [{"type": "function_call_output", "output": "18 C"}]}, ["call_id"], "input[0].call_id"),
    ("/responses", {"input": "hi", "temperature": -1}, ["temperature"], None),
    ("/responses", {"input": "hi", "tool_choice": "required"}, ["tool_choice"], "tool_choice"),
])
def test_bad_input_is_400_naming_the_problem(stack, path, body, words, param):
    error = assert_error(stack.post(path, body), 400, *words)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_bad_input_through_the_openai_client_is_a_bad_request_error(stack):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        stack.client().completions.create(model=stack.model, prompt="hi", top_p=1.5)
    assert stack.client().completions.create(model=stack.model, prompt="hi", max_tokens=2).usage.completion_tokens


def test_unknown_model_is_404(stack):
    error = assert_error(stack.post("/completions", {"model": "gpt-17", "prompt": "hi"}), 404, "gpt-17")
    assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize("key", ["wrong-key", None])
def test_wrong_or_missing_api_key_is_401(stack, key):
    assert_error(stack.post("/completions", {"model": stack.model, "prompt": "hi"}, api_key=key), 401, "API key")
    response = httpx.get(stack.base_url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert_error(response, 401)
    with pytest.raises(openai.AuthenticationError):
        stack.client(api_key=key or "not-the-key").models.list()


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank", "/nowhere"])
def test_routes_outside_v1_need_the_key_too(stack, path):
    assert_error(httpx.post(stack.base_url.removesuffix("/v1") + path, json={}), 401, "API key")


def test_health_needs_no_key(stack):
    assert httpx.get(stack.base_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


# --- clients that hang up -------------------------------------------------------------------------------------
def test_client_that_disconnects_mid_stream_aborts_its_request(stack):
    wait_until(stack.idle, "pools idle before the test")
    before = stack.generated_tokens()
    body = {"model": stack.model, "prompt": "The quick brown fox", "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", stack.base_url + "/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        events = response.iter_lines()
        received = [line for line, _ in zip(events, range(6))]
    assert any(line.startswith("data: ") for line in received)
    wait_until(stack.idle, "every block free again after the hang-up", timeout=20)
    assert stack.generated_tokens() - before < LONG


def test_client_that_disconnects_before_a_non_streamed_answer_aborts_its_request(stack):
    wait_until(stack.idle, "pools idle before the test")
    before = stack.generated_tokens()
    body = {"model": stack.model, "prompt": "Paris is", "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        stack.post("/completions", body, timeout=httpx.Timeout(60, read=0.3))
    wait_until(stack.idle, "every block free again after the hang-up", timeout=20)
    assert stack.generated_tokens() - before < LONG


def test_grpc_calls_need_the_api_key_too(stack):
    import grpc

    from protos import common_pb2, router_pb2, router_pb2_grpc

    request = router_pb2.GenerateRequest(text="The quick brown fox",
                                         sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0))
    stub = router_pb2_grpc.RouterStub(stack.services.channel(stack.grpc_address))
    for metadata in (None, [("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, metadata=metadata, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    answered = list(stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=30))
    assert sum(len(r.token_ids) for r in answered) == 3
