"""Security pieces on their own, without a stack: per-key limits counted (by one router; by routers sharing a real
redis-server; by each router alone while Redis is down), API keys matched exactly, a rediss:// URL with its CA and
password reaching a TLS Redis, bad TLS and secret flags refused with a clear error, and a scheduler that would take
callers from other hosts without a cluster token refused unless --insecure."""
from __future__ import annotations

import asyncio
import importlib
import logging
import os
import subprocess
import sys
import time

import grpc
import pytest
import redis

from base.cluster_auth import matching_key
from base.tls import TlsConfig
from ferry.launcher import free_port
from ferry.stack import Stack
from protos import common_pb2, router_pb2
from protos.registration import SchedulerInfo
from router.core import RequestError, Router
from router.discovery import SchedulerDirectory
from router.limits import KeyLease, KeyLimiter, KeyLimits, OverLimit
from router.shared_limits import SharedKeyLimiter, bucket_key
from scheduler.__main__ import build_parser, check_exposure
from scheduler.presence import Registry
from tests.conftest import make_pki
from tests.services_fixtures import redis_answers, running_redis, start_redis, wait_until
from tests.synthetic_fixtures import synthetic_scheduler

REDIS_PASSWORD = "redis-password-for-tests"


def test_key_limiter_counts_streams_and_tokens_per_key():
    now = [0.0]
    limiter = KeyLimiter(KeyLimits(max_concurrent=2, tokens_per_minute=60), clock=lambda: now[0])
    limiter.admit("a")
    limiter.admit("a")
    with pytest.raises(OverLimit, match="2 concurrent"):
        limiter.admit("a")
    limiter.admit("b")                                    # another key has its own count
    limiter.charge("a", 70)                               # 10 tokens of debt, repaid at 1 token/s
    limiter.release("a")
    with pytest.raises(OverLimit) as over:
        limiter.admit("a")
    assert over.value.retry_after == 11
    now[0] = 11.0
    limiter.admit("a")


def test_a_prompt_the_budget_left_cannot_cover_is_refused_with_the_wait_for_it():
    now = [0.0]
    limiter = KeyLimiter(KeyLimits(tokens_per_minute=60), clock=lambda: now[0])
    limiter.admit("a", 50)                                # charged at admission: 10 left
    with pytest.raises(OverLimit, match="60 tokens a minute") as over:
        limiter.admit("a", 20)
    assert over.value.retry_after == 10                   # 10 tokens short, refilled at 1 token/s
    limiter.admit("a", 10)
    with pytest.raises(OverLimit, match="can never be admitted"):
        limiter.admit("b", 61)


# --- per-key limits shared through Redis -------------------------------------------------------------------
@pytest.fixture
def shared_redis():
    """A redis-server with a password on a free port; yields its URL."""
    with running_redis(REDIS_PASSWORD) as url:
        yield url


def shared_limiter(url: str, limits: KeyLimits, **options) -> SharedKeyLimiter:
    return SharedKeyLimiter(limits, url, REDIS_PASSWORD, **options)


async def admitted(limiter: SharedKeyLimiter, key: str, prompt_tokens: int = 1) -> KeyLease:
    lease = limiter.lease(key)
    await lease.admit(prompt_tokens)
    return lease


async def refusal(limiter: SharedKeyLimiter, key: str, prompt_tokens: int = 1) -> OverLimit:
    with pytest.raises(OverLimit) as over:
        await admitted(limiter, key, prompt_tokens)
    return over.value


async def eventually(attempt, seconds: float = 3.0):
    """attempt()'s result once it stops failing (OverLimit or an assertion), trying for up to `seconds`: what one
    router writes in the background reaches the others a moment later."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await attempt()
        except (OverLimit, pytest.fail.Exception, AssertionError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_two_routers_on_one_redis_admit_a_keys_streams_once(shared_redis):
    async def scenario():
        limits = KeyLimits(max_concurrent=2)
        first, second = shared_limiter(shared_redis, limits), shared_limiter(shared_redis, limits)
        try:
            held = [await admitted(first, "sk-a"), await admitted(second, "sk-a")]
            for limiter in (first, second):
                assert "2 concurrent" in (await refusal(limiter, "sk-a")).message
            await admitted(second, "sk-b")                    # another key has its own count
            await held[0].release()
            await eventually(lambda: admitted(second, "sk-a"))   # the place the first router gave back
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())


def test_two_routers_on_one_redis_share_a_keys_tokens_a_minute_and_store_no_raw_key(shared_redis):
    async def scenario():
        limits = KeyLimits(tokens_per_minute=600)             # 10 tokens/s
        first, second = shared_limiter(shared_redis, limits), shared_limiter(shared_redis, limits)
        try:
            lease = await admitted(first, "sk-a", 400)
            over = await refusal(second, "sk-a", 300)         # 200 left
            assert "600 tokens a minute" in over.message and 9 <= over.retry_after <= 10
            await admitted(second, "sk-a", 150)               # 50 left
            lease.charge(100)                                 # completion tokens: the first router writes them
            await eventually(lambda: refusal(second, "sk-a"))   # in debt
            await admitted(second, "sk-b", 600)               # another key has its own budget
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())
    stored = redis.Redis.from_url(shared_redis, password=REDIS_PASSWORD).keys("*")
    assert bucket_key("sk-a").encode() in stored
    assert all(b"sk-" not in key for key in stored), stored


def test_a_stream_counts_while_its_router_renews_it_and_not_past_its_lease_once_the_router_is_dead(shared_redis):
    lease_s = 1.0

    async def scenario():
        limits = KeyLimits(max_concurrent=1)
        alive, dying = (shared_limiter(shared_redis, limits, lease_s=lease_s) for _ in range(2))
        try:
            await admitted(alive, "sk-live")
            await admitted(dying, "sk-dead")
            dying.syncing.cancel()                            # dead: its stream is neither renewed nor released
            assert "1 concurrent" in (await refusal(alive, "sk-dead")).message
            await asyncio.sleep(2.5 * lease_s)
            assert "1 concurrent" in (await refusal(alive, "sk-live")).message
            await admitted(alive, "sk-dead")
        finally:
            await alive.close()
            await dying.close()

    asyncio.run(scenario())


def test_with_redis_down_each_router_counts_the_limits_alone_says_so_once_and_shares_again_after(caplog):
    port = free_port()
    url, stack = f"redis://127.0.0.1:{port}", Stack()

    async def scenario():
        limiter = shared_limiter(url, KeyLimits(max_concurrent=1, tokens_per_minute=60), retry_s=0.2)
        try:
            held = await admitted(limiter, "sk-a", 10)        # nothing listens on the port: counted here
            assert "1 concurrent" in (await refusal(limiter, "sk-a")).message
            await held.release()
            await asyncio.sleep(0.3)                          # Redis is tried again, and still not there
            assert "60 tokens a minute" in (await refusal(limiter, "sk-a", 55)).message
            start_redis(stack, port, REDIS_PASSWORD)
            wait_until(lambda: redis_answers(url, REDIS_PASSWORD), "redis-server up")
            await asyncio.sleep(0.3)
            await admitted(limiter, "sk-b", 10)
            assert redis.Redis.from_url(url, password=REDIS_PASSWORD).exists(bucket_key("sk-b"))
        finally:
            await limiter.close()

    try:
        with caplog.at_level(logging.WARNING, logger="router.shared_limits"):
            asyncio.run(scenario())
    finally:
        stack.stop()
    messages = [record.getMessage() for record in caplog.records]
    assert sum("redis unreachable" in m for m in messages) == 1, messages
    assert sum("answers again" in m for m in messages) == 1, messages


# --- the prompt's charge, through a Router ------------------------------------------------------------------
def generate_request(num_prompt_tokens: int, max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5] * num_prompt_tokens),
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


def test_a_client_that_hangs_up_keeps_its_prompt_charged_and_a_request_that_fails_first_gets_it_back(tokenizer_dir):
    limiter = KeyLimiter(KeyLimits(tokens_per_minute=600), clock=lambda: 0.0)

    async def scenario():
        async with synthetic_scheduler(tokenizer_dir) as (directory, server):
            router = Router(directory, key_limiter=limiter)
            responses = router.generate(generate_request(200, 50), api_key="sk-a")
            first = await anext(responses)
            await responses.aclose()                          # the client hangs up after its first token
            assert limiter.usage["sk-a"].budget == 600 - 200 - len(first.token_ids)
            await server.stop(0)                              # the only scheduler gone: UNAVAILABLE
            with pytest.raises(RequestError) as failed:
                async for _ in router.generate(generate_request(300, 50), api_key="sk-b"):
                    pass
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE
            assert "sk-b" not in limiter.usage                # given its prompt back, and forgotten

    asyncio.run(scenario())


def test_an_api_key_matches_only_itself():
    keys = ["sk-one", "sk-two"]
    assert matching_key(keys, "sk-two") == "sk-two"
    assert matching_key(keys, "sk-tw") is None and matching_key(keys, "") is None

def start_tls_redis(pki: TlsConfig, port: int) -> subprocess.Popen:
    return subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", pki.cert, "--tls-key-file", pki.key, "--tls-ca-cert-file", pki.ca,
                             "--tls-auth-clients", "no", "--requirepass", REDIS_PASSWORD, "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)


async def register_and_discover(url: str) -> None:
    info = SchedulerInfo("sched-tls", "127.0.0.1:1", "tiny", "/models/tiny", 16, 1024, 512)
    registry, stranger = Registry(url, lambda: info, password=REDIS_PASSWORD), Registry(url, lambda: info)
    directory = SchedulerDirectory(url, redis_password=REDIS_PASSWORD)
    try:
        assert not await stranger.beat()                  # no password: Redis refuses the registration
        assert await registry.beat()
        await directory.refresh()
        assert list(directory.live) == ["sched-tls"]
    finally:
        for closing in (registry.close(), stranger.redis.aclose(), directory.close()):
            await closing


def test_a_rediss_url_with_its_ca_and_the_password_reaches_a_tls_redis(tmp_path):
    pki, port = make_pki(tmp_path, "redis"), free_port()
    server = start_tls_redis(pki, port)
    url = f"rediss://127.0.0.1:{port}?ssl_ca_certs={pki.ca}"
    try:
        wait_until(lambda: redis_answers(url, REDIS_PASSWORD), "TLS Redis up")
        asyncio.run(register_and_discover(url))
    finally:
        server.kill()
        server.wait()


# --- flags -------------------------------------------------------------------------------------------------
def run_main(module: str, flags: list[str], monkeypatch) -> int:
    """`python -m module *flags` up to its exit, in this process."""
    main = importlib.import_module(f"{module}.__main__").main
    monkeypatch.setattr(sys, "argv", [module, *flags])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code


def test_bad_tls_and_secret_flags_are_refused_with_a_clear_error(tmp_path, monkeypatch, capsys):
    pki = make_pki(tmp_path, "flags")
    cases = {("scheduler", "--tls-cert", pki.cert): "--tls-cert and --tls-key go together",
             ("scheduler", "--tls-ca", pki.ca): "--tls-ca needs --tls-cert",
             ("scheduler", "--tls-cert", pki.cert, "--tls-key", pki.ca): "not a matching PEM certificate and key",
             ("router", "--redis-url", "redis://x", "--tls-ca", str(tmp_path / "missing.pem")): "no such file",
             ("router", "--redis-url", "redis://x", "--cluster-token-file", str(tmp_path / "none")): "cannot read"}
    for (module, *flags), message in cases.items():
        assert run_main(module, flags, monkeypatch) == 2
        assert message in capsys.readouterr().err, flags


def test_a_scheduler_on_every_interface_without_a_cluster_token_refuses_to_start_before_loading_anything():
    env = {k: v for k, v in os.environ.items() if k != "FERRY_CLUSTER_TOKEN"}
    result = subprocess.run([sys.executable, "-m", "scheduler", "--host", "0.0.0.0", "--model", "/nonexistent"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert all(flag in result.stderr for flag in ("--cluster-token", "--cluster-token-file", "$FERRY_CLUSTER_TOKEN",
                                                  "--insecure")), result.stderr


def test_a_scheduler_beyond_loopback_needs_a_cluster_token_or_insecure():
    for host in ("0.0.0.0", "::", "10.4.0.17", "scheduler.example"):
        with pytest.raises(ValueError, match="no cluster token"):
            check_exposure(host, "", insecure=False)
        check_exposure(host, "a-token", insecure=False)
        args = build_parser().parse_args(["--host", host, "--insecure"])
        check_exposure(args.host, "", args.insecure)
    for host in ("127.0.0.1", "127.0.0.3", "::1", "[::1]", "localhost"):
        check_exposure(host, "", insecure=False)
