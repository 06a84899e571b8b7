"""Overload, limits, deadlines and hostile input, against real processes."""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.sampling_params import MAX_SAMPLES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from ferry import launcher
from ferry.launcher import free_port
from ferry.stack import Stack as ProcessStack
from protos import common_pb2, router_pb2
from tests.services_fixtures import CHILD_ENV, ServiceStack, collect, greedy, start_services, wait_until

MAX_NUM_SEQS = 2
MAX_QUEUED = 2
MAX_REQUEST_BYTES = 64 << 10
LONG = 400             # tokens: long enough that a flood arrives while the admitted requests still run
ROUTER_MEMORY_CAP = 3 << 30   # address space of a router that must not fill the machine if a test finds a leak


@dataclass
class Stack:
    services: ServiceStack
    http: str

    def post(self, path: str, body: dict | bytes, timeout: float | httpx.Timeout = 60) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.http + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=timeout)

    def idle(self) -> bool:
        return self.services.idle()

    def pids(self) -> list[int]:
        return self.services.pids()


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    http_port = free_port()
    services = start_services(tiny_llama_dir, router_flags=("--http-port", str(http_port), "--max-request-bytes",
                                                            str(MAX_REQUEST_BYTES)),
                              **{"--max-num-seqs": str(MAX_NUM_SEQS), "--max-queued-requests": str(MAX_QUEUED)})
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200, "HTTP health")
        yield Stack(services, f"http://127.0.0.1:{http_port}")
    finally:
        services.stop()


def long_request(text: str = "tell me a long story") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(text=text, sampling=greedy(LONG, ignore_eos=True))


# --- limits ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, words", [
    ({"n": MAX_SAMPLES + 1}, ["n must be in"]),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, ["stop strings"]),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, ["characters"]),
    ({"stop_token_ids": list(range(300))}, ["stop_token_ids"]),
    ({"temperature": math.nan}, ["temperature", "finite"]),
    ({"top_p": math.inf}, ["top_p"]),
    ({"logprobs": 21}, ["logprobs"]),
])
def test_sampling_limits_name_the_field(fields, words):
    with pytest.raises(ValueError) as error:
        SamplingParams(**fields)
    assert all(w in str(error.value) for w in words)


def test_oversized_grpc_request_is_invalid_argument_and_the_router_keeps_serving(stack):
    with pytest.raises(grpc.RpcError) as error:
        list(stack.services.router().Generate(router_pb2.GenerateRequest(text="a" * (MAX_REQUEST_BYTES + 10),
                                                                          sampling=greedy(2)), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in error.value.details()
    token_ids, _, _ = collect(stack.services.router().Generate(
        router_pb2.GenerateRequest(text="hello", sampling=greedy(2)), timeout=30))
    assert len(token_ids) == 2


def test_oversized_http_body_is_413_before_it_is_read(stack):
    response = stack.post("/v1/completions", {"prompt": "a" * (MAX_REQUEST_BYTES + 10), "max_tokens": 2})
    assert response.status_code == 413 and "exceeds the limit" in response.json()["error"]["message"]
    assert stack.post("/v1/completions", {"prompt": "hello", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body, words", [
    ({"prompt": "hi", "n": MAX_SAMPLES + 1}, ["n must be in"]),
    ({"prompt": "hi", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, ["stop strings"]),
    ({"prompt": "hi", "stop": "s" * (MAX_STOP_STRING_CHARS + 1)}, ["characters"]),
    ({"prompt": "hi", "logprobs": 50}, ["logprobs"]),
    ({"prompt": [5] * 2000}, ["max_model_len"]),
])
def test_limits_over_http_are_400_with_the_reason(stack, body, words):
    response = stack.post("/v1/completions", {"max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert all(w in response.json()["error"]["message"] for w in words)


# --- overload ----------------------------------------------------------------------------------------------
def flood_grpc(stack: Stack, count: int) -> list[tuple[str, float, int, tuple]]:
    """count concurrent long streams; each: (status name, seconds to the answer, tokens, trailing metadata)."""
    def one(i: int):
        started = time.monotonic()
        call = stack.services.router().Generate(long_request(f"story number {i}"), timeout=120)
        try:
            tokens = sum(len(m.token_ids) for m in call)
            return "OK", time.monotonic() - started, tokens, ()
        except grpc.RpcError as e:
            return e.code().name, time.monotonic() - started, 0, tuple(e.trailing_metadata() or ())

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_overload_gets_resource_exhausted_promptly_and_admitted_requests_complete(stack):
    capacity = len(stack.services.scheduler_addresses) * (MAX_NUM_SEQS + MAX_QUEUED)
    results = flood_grpc(stack, 10 * capacity)
    ok = [r for r in results if r[0] == "OK"]
    refused = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == len(results), {r[0] for r in results}
    assert len(ok) >= capacity and len(refused) >= len(results) // 2
    assert all(tokens == LONG for _, _, tokens, _ in ok)
    assert all(("retry-after", "1") in metadata for *_, metadata in refused)
    # refusals come back while the admitted requests still run
    assert max(seconds for _, seconds, _, _ in refused) < max(seconds for _, seconds, _, _ in ok)
    wait_until(stack.idle, "every pool back to all-free", timeout=30)


def test_overload_over_http_is_429_with_retry_after(stack):
    body = {"prompt": "a story", "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    capacity = len(stack.services.scheduler_addresses) * (MAX_NUM_SEQS + MAX_QUEUED)
    with ThreadPoolExecutor(5 * capacity) as pool:
        responses = list(pool.map(lambda _: stack.post("/v1/completions", body, timeout=120), range(5 * capacity)))
    statuses = sorted({r.status_code for r in responses})
    assert statuses == [200, 429], statuses
    refused = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == LONG for r in responses if r.status_code == 200)
    wait_until(stack.idle, "every pool back to all-free", timeout=30)


def test_memory_stays_bounded_under_repeated_overload(stack):
    flood_grpc(stack, 40)   # warm-up: allocator pools, channels, compiled paths
    wait_until(stack.idle, "idle after warm-up", timeout=30)
    before = {pid: rss_bytes(pid) for pid in stack.pids()}
    for _ in range(3):
        flood_grpc(stack, 40)
    wait_until(stack.idle, "idle after the floods", timeout=30)
    grown = {pid: rss_bytes(pid) - rss for pid, rss in before.items()}
    assert max(grown.values()) < 32 << 20, grown


# --- deadlines ---------------------------------------------------------------------------------------------
def test_grpc_deadline_aborts_the_request_and_frees_its_blocks(stack):
    request = router_pb2.GenerateRequest(text="tell me a long story", sampling=greedy(1000, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as error:   # 1000 tokens: not done in 0.2 s even on a fast CPU
        list(stack.services.router().Generate(request, timeout=0.2))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(stack.idle, "blocks freed after the deadline", timeout=10)


def test_http_client_timeout_aborts_the_request_and_frees_its_blocks(stack):
    body = {"prompt": "a story", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        stack.post("/v1/completions", body, timeout=httpx.Timeout(10, read=0.5))
    wait_until(stack.idle, "blocks freed after the client timed out", timeout=10)


# --- hostile input -----------------------------------------------------------------------------------------
@contextmanager
def capped_router(stack: Stack) -> Iterator[str]:
    """One more router over the stack's schedulers, its address space capped (a runaway allocation fails there
    instead of taking the machine); yields its HTTP address."""
    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ROUTER_MEMORY_CAP, ROUTER_MEMORY_CAP))

    port, http_port = free_port(), free_port()
    processes = ProcessStack()
    try:
        processes.start([sys.executable, "-m", "router", "--port", str(port), "--http-port", str(http_port),
                         "--redis-url", stack.services.redis_url], "capped router", env=CHILD_ENV,
                        preexec_fn=cap_memory)
        launcher.wait_for_health(f"127.0.0.1:{port}", processes, timeout=60)
        http = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: httpx.get(http + "/health").status_code == 200, "the capped router's schedulers")
        yield http
    finally:
        processes.stop()


def test_a_huge_n_is_400_and_the_router_keeps_serving(stack):
    """n = 2**31 once made the router build that many empty choices before the stream checked n: it hung, then
    the kernel killed it for memory (a CI run of the fuzz test below)."""
    bodies = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": [{"role": "user",
                                                                                          "content": "hi"}]}}
    with capped_router(stack) as http:
        for path, body in bodies.items():
            response = httpx.post(http + path, json={**body, "max_tokens": 2, "n": 2**31}, timeout=30)
            assert response.status_code == 400, response.text
            assert "n must be in" in response.json()["error"]["message"]
            assert httpx.post(http + path, json={**body, "max_tokens": 2}, timeout=60).status_code == 200


def any_text(max_size: int) -> st.SearchStrategy[str]:
    """Any code point, lone UTF-16 surrogates included (st.text leaves them out; JSON can spell them: \\ud800)."""
    return st.text(st.characters(exclude_categories=()), max_size=max_size)


ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | any_text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text(max_size=6), inner,
                                                                                   max_size=3), max_leaves=6)
SMALL_INT = st.integers(-3, 6) | st.sampled_from([0, 2**31, 2**32, 2**63, -2**63])
SAMPLING_FIELDS = {
    "max_tokens": SMALL_INT | ANY_JSON, "temperature": st.floats() | ANY_JSON, "top_p": st.floats(),
    "top_k": SMALL_INT, "min_p": st.floats(), "n": SMALL_INT, "seed": SMALL_INT | ANY_JSON,
    "stop": any_text(max_size=4) | st.lists(any_text(max_size=4), max_size=20) | ANY_JSON,
    "stop_token_ids": st.lists(SMALL_INT, max_size=3) | ANY_JSON, "logprobs": SMALL_INT | st.booleans(),
    "top_logprobs": SMALL_INT, "presence_penalty": st.floats(), "frequency_penalty": st.floats(),
    "repetition_penalty": st.floats(), "ignore_eos": st.booleans() | ANY_JSON, "stream": st.booleans(),
    "echo": st.booleans(), "model": any_text(max_size=6) | ANY_JSON,
}
PROMPTS = any_text(max_size=20) | st.lists(st.integers(-5, 2**33), max_size=6) | ANY_JSON
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": any_text(max_size=12) | ANY_JSON}), max_size=3) | ANY_JSON
INPUTS = any_text(max_size=20) | st.lists(st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
    "role": st.sampled_from(["user", "developer", "assistant", "tool"]), "content": any_text(max_size=12) | ANY_JSON,
    "call_id": any_text(max_size=4), "name": any_text(max_size=4), "arguments": any_text(max_size=8),
    "output": any_text(max_size=8) | ANY_JSON}), max_size=3) | ANY_JSON


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]),
       fields=st.fixed_dictionaries({}, optional={"prompt": PROMPTS, "messages": MESSAGES, "input": INPUTS,
                                                  "instructions": any_text(max_size=8) | ANY_JSON,
                                                  **SAMPLING_FIELDS}))
def test_fuzzed_http_requests_never_get_a_server_error(stack, path, fields):
    if fields.get("max_tokens") is None or not isinstance(fields.get("max_tokens"), int):
        fields["max_tokens"] = 3       # keep the valid ones short (chat would otherwise fill the context)
    fields["max_output_tokens"] = fields["max_tokens"]   # the Responses API's name for it
    response = stack.post(path, fields)
    assert response.status_code in (200, 400, 404, 429), (response.status_code, response.text)
    if response.status_code != 200:
        assert response.json()["error"]["message"]


FLOATS = st.floats(width=32)
PROTO_SAMPLING = st.builds(
    common_pb2.SamplingParams, max_tokens=st.integers(0, 6) | st.just(2**32 - 1), temperature=FLOATS, top_p=FLOATS,
    top_k=st.integers(-2**31, 2**31 - 1), min_p=FLOATS, seed=st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=5), max_size=20), stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4),
    presence_penalty=FLOATS, frequency_penalty=FLOATS, repetition_penalty=FLOATS, logprobs=st.integers(0, 30),
    n=st.integers(0, 20), ignore_eos=st.booleans())
PROTO_PROMPT = (st.builds(lambda t: {"text": t}, st.text(max_size=20))
                | st.builds(lambda ids: {"token_ids": router_pb2.TokenIds(ids=ids)},
                            st.lists(st.integers(0, 2**32 - 1), max_size=5))
                | st.builds(lambda ms: {"chat": router_pb2.ChatMessages(messages=ms)},
                            st.lists(st.builds(router_pb2.ChatMessage, role=st.text(max_size=5),
                                               content=st.text(max_size=10)), max_size=3)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompt=PROTO_PROMPT, sampling=PROTO_SAMPLING, model=st.text(max_size=4))
def test_fuzzed_grpc_requests_never_get_internal_or_unknown(stack, prompt, sampling, model):
    request = router_pb2.GenerateRequest(sampling=sampling, model=model, **prompt)
    try:
        list(stack.services.router().Generate(request, timeout=60))
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (e.code(),
                                                                                                    e.details())
        assert e.details()
