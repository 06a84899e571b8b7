"""Every hop authenticated, TLS on the ports that leave the host: a real stack (redis-server with a password, a
scheduler with its worker, a router) with the cluster token, TLS on every TCP port (certificates made with
`cryptography` by conftest.make_pki) and per-API-key limits, shared by the routers on its Redis. The pieces on their
own: test_security_checks.py."""
from __future__ import annotations

import os
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis

from base.cluster_auth import token_metadata
from base.tls import TlsConfig
from ferry.launcher import free_port, wait_for_health
from ferry.stack import Stack as ProcessStack
from protos import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import make_pki
from tests.services_fixtures import (CHILD_ENV, Secured, ServiceStack, child_pids, greedy, registered_schedulers,
                                     served_alone, start_services, wait_until)

CLUSTER_TOKEN = "cluster-token-for-tests"
REDIS_PASSWORD = "redis-password-for-tests"
TOKENS_PER_MINUTE = 300
KEYS = ("sk-e2e", "sk-sdk", "sk-busy", "sk-other", "sk-rate", "sk-hangup", "sk-prompt", "sk-shared", "sk-shared-tokens",
        "sk-down")
WORKER_ENV = {"FERRY_CPU_KERNELS": "0"}   # what is tested here is the hops: torch ops, no wait on a kernel build


@dataclass
class SecureStack:
    services: ServiceStack
    tls: TlsConfig
    http_base: str
    log_dir: Path
    router_flags: tuple[str, ...]   # but the ports and Redis: for another router on the stack

    @property
    def scheduler(self) -> str:
        return self.services.scheduler_addresses[0]

    def scheduler_stub(self, tls: TlsConfig | None = None) -> scheduler_pb2_grpc.SchedulerStub:
        channel = grpc.secure_channel(self.scheduler, (tls or self.tls).channel_credentials())
        return scheduler_pb2_grpc.SchedulerStub(channel)

    def router(self, address: str = "") -> router_pb2_grpc.RouterStub:
        credentials = grpc.ssl_channel_credentials(Path(self.tls.ca).read_bytes())
        return router_pb2_grpc.RouterStub(grpc.secure_channel(address or self.services.router_address, credentials))

    def https(self) -> httpx.Client:
        return httpx.Client(verify=ssl.create_default_context(cafile=self.tls.ca), timeout=60)

    def post(self, client: httpx.Client, key: str, max_tokens: int, **body) -> httpx.Response:
        """A completion of `max_tokens` tokens under `key`."""
        return client.post(self.http_base + "/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"prompt": "Paris is the capital of", "max_tokens": max_tokens, **body})

    def counters(self) -> tuple[int, int, int]:
        stats = self.services.scheduler_stats(self.scheduler)
        return stats.prompt_tokens_total, stats.generation_tokens_total, stats.num_waiting + stats.num_running


@pytest.fixture(scope="module")
def secure(tiny_llama_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("security")
    tls = make_pki(directory, "ferry")
    http_port = free_port()
    tls_flags = ("--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca)
    router_flags = ("--cluster-token", CLUSTER_TOKEN, *tls_flags, *[a for key in KEYS for a in ("--api-key", key)],
                    "--max-concurrent-requests-per-key", "1", "--max-tokens-per-minute-per-key", str(TOKENS_PER_MINUTE))
    secured = Secured(REDIS_PASSWORD, tls, CLUSTER_TOKEN, directory)
    services = start_services(tiny_llama_dir, 1, ("--http-port", str(http_port), *router_flags), WORKER_ENV, secured,
                              **{"--cluster-token": CLUSTER_TOKEN, "--tls-cert": tls.cert, "--tls-key": tls.key,
                                 "--tls-ca": tls.ca})
    stack = SecureStack(services, tls, f"https://127.0.0.1:{http_port}/v1", directory, router_flags)
    try:
        with stack.https() as client:
            wait_until(lambda: client.get(f"https://127.0.0.1:{http_port}/health").status_code == 200, "HTTPS health")
        yield stack
    finally:
        services.stop()


# --- the cluster token -------------------------------------------------------------------------------------
def scheduler_request(request_id: str) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=[5, 6, 7, 8], sampling=greedy(4))


@pytest.mark.parametrize("metadata", [(), token_metadata("not-the-token")], ids=["no token", "wrong token"])
def test_scheduler_refuses_calls_without_the_cluster_token_and_does_no_work(secure, metadata):
    stub, before = secure.scheduler_stub(), secure.counters()
    calls = {"Stats": lambda: stub.Stats(scheduler_pb2.StatsRequest(), timeout=10, metadata=metadata),
             "Connect": lambda: list(stub.Connect(iter([scheduler_pb2.ConnectRequest(submit=scheduler_pb2.SubmitRequest(
                 request=scheduler_request("c")))]), timeout=10, metadata=metadata))}
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert "cluster token" in refused.value.details()
    assert secure.counters() == before            # nothing was queued, prefilled or generated
    log = (secure.log_dir / "sched-0.log").read_text()
    assert "refused /ferry.Scheduler/Connect from ipv4:127.0.0.1:" in log


def test_scheduler_serves_callers_with_the_token(secure):
    stream = served_alone(secure.scheduler_stub(), [5, 6, 7, 8], greedy(4), timeout=30,
                          metadata=token_metadata(CLUSTER_TOKEN))
    assert len(stream.tokens("alone")) == 4 and not stream.errors


def test_scheduler_health_stays_open_for_probes_without_the_token(secure):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.secure_channel(secure.scheduler, secure.tls.channel_credentials())
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_workers_socket_lies_in_a_directory_only_its_user_can_open(secure):
    worker = child_pids(secure.services.schedulers[0].pid)[0]
    argv = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
    socket_path = Path(argv[argv.index(b"--socket") + 1].decode())
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    directory = socket_path.parent.stat()
    assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.getuid()


# --- TLS ---------------------------------------------------------------------------------------------------
def test_the_whole_stack_answers_over_tls(secure):
    request = router_pb2.GenerateRequest(text="Paris is the capital of", sampling=greedy(8))
    responses = list(secure.router().Generate(request, timeout=60, metadata=[("authorization", "Bearer sk-e2e")]))
    assert sum(len(r.token_ids) for r in responses) == 8
    assert responses[-1].usage.completion_tokens == 8


def test_a_plain_text_client_is_refused_on_every_port(secure):
    request = router_pb2.GenerateRequest(text="hello", sampling=greedy(2))
    with pytest.raises(grpc.RpcError) as plain_grpc:
        list(router_pb2_grpc.RouterStub(grpc.insecure_channel(secure.services.router_address)).Generate(
            request, timeout=10, metadata=[("authorization", "Bearer sk-e2e")]))
    assert plain_grpc.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.TransportError):
        httpx.get(secure.http_base.replace("https://", "http://") + "/models", timeout=10)
    with pytest.raises(grpc.RpcError) as plain_scheduler:
        scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(secure.scheduler)).Stats(
            scheduler_pb2.StatsRequest(), timeout=10, metadata=token_metadata(CLUSTER_TOKEN))
    assert plain_scheduler.value.code() == grpc.StatusCode.UNAVAILABLE


def test_scheduler_refuses_a_tls_client_without_a_certificate_its_ca_signed(secure, tmp_path):
    stranger = make_pki(tmp_path, "stranger")
    no_certificate = TlsConfig(ca=secure.tls.ca)
    wrong_ca = TlsConfig(stranger.cert, stranger.key, secure.tls.ca)
    for tls in (no_certificate, wrong_ca):
        with pytest.raises(grpc.RpcError) as refused:
            secure.scheduler_stub(tls).Stats(scheduler_pb2.StatsRequest(), timeout=10,
                                             metadata=token_metadata(CLUSTER_TOKEN))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_openai_sdk_works_over_https_with_the_test_ca(secure):
    with secure.https() as http_client:
        client = openai.OpenAI(base_url=secure.http_base, api_key="sk-sdk", http_client=http_client, max_retries=0)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
        assert chat.usage.completion_tokens == 6
        stream = client.completions.create(model=model, prompt="Paris is", max_tokens=5, stream=True)
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1


# --- per-key limits ----------------------------------------------------------------------------------------
def test_a_key_over_its_concurrency_cap_gets_429_while_another_key_is_served(secure):
    long = {"max_tokens": 900, "ignore_eos": True, "n": 4}
    with secure.https() as client, ThreadPoolExecutor(5) as pool:
        busy = [pool.submit(secure.post, client, "sk-busy", **long) for _ in range(5)]
        other = secure.post(client, "sk-other", 4)
        responses = [f.result() for f in busy]
    assert other.status_code == 200
    assert sorted({r.status_code for r in responses}) == [200, 429]
    for refused in (r for r in responses if r.status_code == 429):
        assert int(refused.headers["Retry-After"]) >= 1
        assert "1 concurrent requests" in refused.json()["error"]["message"]


def test_a_key_past_its_token_rate_gets_429_with_retry_after_while_another_key_is_served(secure):
    with secure.https() as client:
        assert secure.post(client, "sk-rate", TOKENS_PER_MINUTE + 20, ignore_eos=True).status_code == 200
        refused = secure.post(client, "sk-rate", 4)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 4   # at 5 tokens/s, 20+ tokens of debt take 4+ s to repay
        assert f"{TOKENS_PER_MINUTE} tokens a minute" in refused.json()["error"]["message"]
        assert secure.post(client, "sk-other", 4).status_code == 200
    request = router_pb2.GenerateRequest(text="hello", sampling=greedy(2))
    with pytest.raises(grpc.RpcError) as over_grpc:
        list(secure.router().Generate(request, timeout=10, metadata=[("authorization", "Bearer sk-rate")]))
    assert over_grpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(over_grpc.value.trailing_metadata())["retry-after"]) >= 4


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def token_prompt(num_tokens: int, max_tokens: int = 1) -> router_pb2.GenerateRequest:
    """A prompt of exactly num_tokens tokens."""
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5 + i % 50 for i in range(num_tokens)]),
                                      sampling=greedy(max_tokens, ignore_eos=True))


def refused(stub: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest, key: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=60, metadata=bearer(key)))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.value.details()
    return error.value


def refused_for(reason: str, stub: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest,
                key: str) -> grpc.RpcError:
    """The refusal once it is for `reason`: a stream its client just cancelled gives its place back a moment
    later, and until then the refusal is for the key's one concurrent stream."""
    deadline = time.monotonic() + 10
    while reason not in (error := refused(stub, request, key)).details() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reason in error.details(), error.details()
    return error


def retry_after(error: grpc.RpcError) -> int:
    return int(dict(error.trailing_metadata())["retry-after"])


def test_a_client_that_hangs_up_after_its_first_token_is_still_charged_its_prompt(secure):
    stream = secure.router().Generate(token_prompt(250, 50), timeout=60, metadata=bearer("sk-hangup"))
    next(stream)
    stream.cancel()
    # 300 - 250 charged at admission, refilled at 5 tokens/s: a 100-token prompt is refused
    refused_for(f"{TOKENS_PER_MINUTE} tokens a minute", secure.router(), token_prompt(100), "sk-hangup")


def test_a_prompt_bigger_than_the_keys_budget_left_is_refused_with_retry_after(secure):
    stub = secure.router()
    assert len(list(stub.Generate(token_prompt(200), timeout=60, metadata=bearer("sk-prompt")))) == 1
    over = refused(stub, token_prompt(150), "sk-prompt")          # about 100 left
    assert f"{TOKENS_PER_MINUTE} tokens a minute" in over.details()
    assert 5 <= retry_after(over) <= 11                            # about 50 short, refilled at 5 tokens/s
    with secure.https() as client:
        over_http = client.post(secure.http_base + "/completions", headers={"Authorization": "Bearer sk-prompt"},
                                json={"prompt": list(token_prompt(150).token_ids.ids), "max_tokens": 1})
    assert over_http.status_code == 429 and int(over_http.headers["Retry-After"]) >= 5, over_http.text
    assert list(stub.Generate(token_prompt(20), timeout=60, metadata=bearer("sk-prompt")))   # one it covers


@contextmanager
def another_router(secure: SecureStack) -> Iterator[router_pb2_grpc.RouterStub]:
    """A second router on the stack's Redis, with the same flags: a second pod, or one of `--workers 2`."""
    port, processes = free_port(), ProcessStack()
    try:
        processes.start([sys.executable, "-m", "router", "--port", str(port), "--http-port", "0",
                         "--redis-url", secure.services.redis_url, "--redis-password", REDIS_PASSWORD,
                         *secure.router_flags], "second router", env=CHILD_ENV)
        wait_for_health(f"127.0.0.1:{port}", processes, timeout=60, tls=secure.tls)
        yield secure.router(f"127.0.0.1:{port}")
    finally:
        processes.stop()


def test_two_routers_on_one_redis_give_a_key_its_limits_once(secure):
    with another_router(secure) as second:
        stream = secure.router().Generate(token_prompt(10, 900), timeout=60, metadata=bearer("sk-shared"))
        next(stream)
        assert "1 concurrent" in refused(second, token_prompt(10), "sk-shared").details()
        stream.cancel()
        wait_until(lambda: served(second, "sk-shared"), "the place the first router gave back, on the second")
        assert list(secure.router().Generate(token_prompt(250), timeout=60, metadata=bearer("sk-shared-tokens")))
        assert f"{TOKENS_PER_MINUTE} tokens a minute" in refused(second, token_prompt(100),
                                                                 "sk-shared-tokens").details()


def served(stub: router_pb2_grpc.RouterStub, key: str) -> bool:
    try:
        return bool(list(stub.Generate(token_prompt(10), timeout=60, metadata=bearer(key))))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False


def test_with_redis_down_a_router_still_applies_the_limits_and_serves(secure):
    def while_down():
        stream = secure.router().Generate(token_prompt(10, 900), timeout=60, metadata=bearer("sk-down"))
        next(stream)
        assert "1 concurrent" in refused(secure.router(), token_prompt(10), "sk-down").details()
        assert served(secure.router(), "sk-other")
        stream.cancel()

    secure.services.restart_redis(while_down)
    wait_until(lambda: registered_schedulers(secure.services), "the scheduler registered in the new Redis")


# --- Redis -------------------------------------------------------------------------------------------------
def test_redis_refuses_clients_without_the_password_and_the_stack_uses_it(secure):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=secure.services.redis_port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=secure.services.redis_port, password="wrong").ping()
    assert secure.services.redis().keys("ferry:scheduler:*")   # the scheduler registered with the password


def test_ferry_generate_reaches_a_tls_router_with_its_ca(secure):
    ferry = str(Path(sys.executable).parent / "ferry")
    result = subprocess.run([ferry, "generate", "Paris is", "--router", secure.services.router_address,
                             "--tls-ca", secure.tls.ca, "--api-key", "sk-e2e", "--max-tokens", "3"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "3 completion tokens" in result.stderr, result.stderr
