"""Overload, limits, deadlines, hostile input and graceful shutdown, against real processes."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.launcher import Stack as LauncherStack
from ferry.launcher import free_port, wait_for_health
from base.sampling_params import MAX_SAMPLES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from protos import common_pb2, router_pb2, scheduler_pb2_grpc
from tests.services_fixtures import (CHILD_ENV, ConnectStream, ServiceStack, child_pids, collect, greedy,
                                     indexed_blocks, served_alone, start_services, wait_until)

MAX_NUM_SEQS = 2
MAX_QUEUED = 2
MAX_REQUEST_BYTES = 64 << 10
LONG = 400             # tokens: long enough that a flood arrives while the admitted requests still run


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
        """Router, schedulers and their workers."""
        own = [p.pid for p in self.services.stack.processes if p.args[0] != "redis-server"]
        return own + [c for p in self.services.schedulers for c in child_pids(p.pid)]


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


def test_oversized_http_body_is_400_before_it_is_read(stack):
    response = stack.post("/v1/completions", {"prompt": "a" * (MAX_REQUEST_BYTES + 10), "max_tokens": 2})
    assert response.status_code == 400 and "exceeds the limit" in response.json()["error"]["message"]
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
    with pytest.raises(grpc.RpcError) as error:
        list(stack.services.router().Generate(long_request(), timeout=0.5))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(stack.idle, "blocks freed after the deadline", timeout=10)


def test_http_client_timeout_aborts_the_request_and_frees_its_blocks(stack):
    body = {"prompt": "a story", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        stack.post("/v1/completions", body, timeout=httpx.Timeout(10, read=0.5))
    wait_until(stack.idle, "blocks freed after the client timed out", timeout=10)


# --- hostile input -----------------------------------------------------------------------------------------
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=3), max_leaves=6)
SMALL_INT = st.integers(-3, 6) | st.sampled_from([0, 2**31, 2**32, 2**63, -2**63])
SAMPLING_FIELDS = {
    "max_tokens": SMALL_INT | ANY_JSON, "temperature": st.floats() | ANY_JSON, "top_p": st.floats(),
    "top_k": SMALL_INT, "min_p": st.floats(), "n": SMALL_INT, "seed": SMALL_INT | ANY_JSON,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20) | ANY_JSON,
    "stop_token_ids": st.lists(SMALL_INT, max_size=3) | ANY_JSON, "logprobs": SMALL_INT | st.booleans(),
    "top_logprobs": SMALL_INT, "presence_penalty": st.floats(), "frequency_penalty": st.floats(),
    "repetition_penalty": st.floats(), "ignore_eos": st.booleans() | ANY_JSON, "stream": st.booleans(),
    "echo": st.booleans(), "model": st.text(max_size=6) | ANY_JSON,
}
PROMPTS = st.text(max_size=20) | st.lists(st.integers(-5, 2**33), max_size=6) | ANY_JSON
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=12) | ANY_JSON}), max_size=3) | ANY_JSON


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       fields=st.fixed_dictionaries({}, optional={"prompt": PROMPTS, "messages": MESSAGES, **SAMPLING_FIELDS}))
def test_fuzzed_http_requests_never_get_a_server_error(stack, path, fields):
    if fields.get("max_tokens") is None or not isinstance(fields.get("max_tokens"), int):
        fields["max_tokens"] = 3       # keep the valid ones short (chat would otherwise fill the context)
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


# --- graceful shutdown -------------------------------------------------------------------------------------
def start_scheduler(model_dir, redis_url: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port, alone = free_port(), LauncherStack()
    process = alone.start([sys.executable, "-m", "scheduler", "--model", str(model_dir), "--dtype", "float32",
                           "--kv-cache-memory", "4000000", "--port", str(port), "--redis-url", redis_url,
                           "--scheduler-id", f"drain-{port}", "--heartbeat-ttl", "30", *flags], "scheduler",
                          env=CHILD_ENV)
    wait_for_health(f"127.0.0.1:{port}", alone, timeout=180)
    return process, f"127.0.0.1:{port}"


def scheduler_keys(redis, scheduler_id: str) -> list[bytes]:
    return indexed_blocks(redis, scheduler_id) + list(redis.scan_iter(match=f"ferry:scheduler:{scheduler_id}"))


def test_sigterm_drains_in_flight_requests_deregisters_and_exits_zero(stack, tiny_llama_dir):
    process, address = start_scheduler(tiny_llama_dir, stack.services.redis_url)
    scheduler_id = f"drain-{address.rsplit(':', 1)[1]}"
    redis = stack.services.redis()
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(address))
        served_alone(stub, list(range(5, 69)), greedy(1))
        wait_until(lambda: len(scheduler_keys(redis, scheduler_id)) > 1, "registered with prefix blocks")
        stream = ConnectStream(stub)
        stream.submit("long", [5, 6, 7], greedy(LONG, ignore_eos=True))
        stream.read_until(lambda: stream.outputs["long"])
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: not scheduler_keys(redis, scheduler_id), "deregistered and prefix entries withdrawn")
        connected = ConnectStream(stub)
        connected.submit("while-draining", [5, 6], greedy(2))
        connected.read_until(lambda: connected.done("while-draining"))
        assert connected.errors["while-draining"].code == grpc.StatusCode.UNAVAILABLE.value[0]
        connected.cancel()
        stream.read_until(lambda: stream.done("long"))
        assert len(stream.tokens("long")) == LONG and not stream.errors   # finished, not cut off
        stream.cancel()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_sigterm_fails_what_outlasts_the_drain_timeout_with_unavailable(stack, tiny_llama_dir):
    process, address = start_scheduler(tiny_llama_dir, stack.services.redis_url, "--drain-timeout", "0.5")
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(address))
        connected = ConnectStream(stub)
        connected.submit("connected", [5, 6, 8], greedy(1000, ignore_eos=True))
        connected.read_until(lambda: connected.outputs["connected"])
        worker = child_pids(process.pid)[0]
        process.send_signal(signal.SIGTERM)
        connected.read_until(lambda: connected.done("connected"))
        failure = connected.errors["connected"]
        assert failure.code == grpc.StatusCode.UNAVAILABLE.value[0] and "drain timeout" in failure.message
        connected.cancel()
        assert process.wait(timeout=30) == 0
        wait_until(lambda: not os.path.exists(f"/proc/{worker}"), "the worker exited with its scheduler")
    finally:
        if process.poll() is None:
            process.kill()


# --- soak --------------------------------------------------------------------------------------------------
SOAK_PROMPTS = [f"Soak prompt {i}: the quick brown fox jumps over the lazy dog" for i in range(8)]
SOAK_MAX_TOKENS = 24
SOAK_REQUESTS = 300
INVALID_SAMPLING = [{"top_p": 0.0}, {"n": MAX_SAMPLES + 1}, {"temperature": -1.0}, {"stop": [""]},
                    {"max_tokens": 5000}, {"logprobs": 99}, {"repetition_penalty": 0.0}]
# what a valid request may end with besides its tokens, and why: a killed worker, a full queue, its own
# deadline, its own cancellation
ALLOWED_FAILURES = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED"}


@dataclass
class SoakCase:
    prompt: int
    sampling: common_pb2.SamplingParams
    valid: bool
    greedy: bool
    timeout: float | None
    cancel_after_first: bool


def soak_case(rng) -> SoakCase:
    max_tokens = rng.randint(1, SOAK_MAX_TOKENS)
    if rng.random() < 0.15:
        prompt = rng.randrange(len(SOAK_PROMPTS))
        invalid = common_pb2.SamplingParams(**{"max_tokens": 4, **rng.choice(INVALID_SAMPLING)})
        return SoakCase(prompt, invalid, False, False, None, False)
    is_greedy = rng.random() < 0.6
    sampling = (greedy(max_tokens, ignore_eos=True) if is_greedy else
                common_pb2.SamplingParams(max_tokens=max_tokens, temperature=rng.uniform(0.5, 1.5),
                                          top_p=rng.uniform(0.5, 1.0), seed=rng.randrange(1000), ignore_eos=True,
                                          n=rng.choice([1, 1, 2])))
    timeout = rng.choice([None] * 6 + [0.05, 1.0])
    return SoakCase(rng.randrange(len(SOAK_PROMPTS)), sampling, True, is_greedy, timeout, rng.random() < 0.1)


def run_soak_case(services: ServiceStack, case: SoakCase) -> tuple[str, list[int], str]:
    call = services.router().Generate(router_pb2.GenerateRequest(text=SOAK_PROMPTS[case.prompt],
                                                                 sampling=case.sampling),
                                      timeout=case.timeout or 60)
    tokens: list[int] = []
    try:
        for message in call:
            tokens += message.token_ids
            if case.cancel_after_first:
                call.cancel()
        return "OK", tokens, ""
    except grpc.RpcError as e:
        return e.code().name, tokens, e.details() or ""


def test_soak_with_a_killed_worker_and_a_redis_restart_loses_and_leaks_nothing(tiny_llama_dir):
    import random

    from base.config import EngineConfig
    from ferry.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    expected = [r.token_ids for r in engine.generate(SOAK_PROMPTS, SamplingParams(
        max_tokens=SOAK_MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    rng = random.Random(1234)
    cases = [soak_case(rng) for _ in range(SOAK_REQUESTS)]
    services = start_services(tiny_llama_dir)
    try:
        workers_before = {p.pid: child_pids(p.pid) for p in services.schedulers}
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(run_soak_case, services, case) for case in cases]
            futures[SOAK_REQUESTS // 3].result()
            os.kill(workers_before[services.schedulers[1].pid][0], signal.SIGKILL)
            futures[2 * SOAK_REQUESTS // 3].result()
            services.restart_redis(lambda: futures[3 * SOAK_REQUESTS // 4].result())
            results = [f.result() for f in futures]
        for case, (status, tokens, details) in zip(cases, results):
            if not case.valid:
                assert status == "INVALID_ARGUMENT" and details, (case, status)
            elif status != "OK":
                assert status in ALLOWED_FAILURES and (details or status == "CANCELLED"), (case, status, details)
            elif case.cancel_after_first:
                assert tokens
            elif case.greedy:
                assert tokens == expected[case.prompt][:case.sampling.max_tokens], case
            else:
                assert len(tokens) == case.sampling.max_tokens * max(1, case.sampling.n), case
        statuses = [status for status, _, _ in results]
        print("soak outcomes:", {s: statuses.count(s) for s in set(statuses)})
        assert statuses.count("OK") > SOAK_REQUESTS // 3, {s: statuses.count(s) for s in set(statuses)}
        wait_until(services.idle, "every pool back to all-free (cached blocks count as free)",
                   timeout=30)
        for scheduler in services.schedulers:          # one live worker each, the killed one reaped
            assert scheduler.poll() is None and len(child_pids(scheduler.pid)) == 1
        pids = Stack(services, "").pids()
    finally:
        services.stop()
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), "no process left behind",
               timeout=10)
