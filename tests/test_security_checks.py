"""Security pieces on their own, without a stack: per-key limits counted, API keys matched exactly, a rediss://
URL with its CA and password reaching a TLS Redis, bad TLS and secret flags refused with a clear error, and a
scheduler that would take callers from other hosts without a cluster token refused unless --insecure."""
from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys

import pytest
import redis

from base.cluster_auth import matching_key
from base.tls import TlsConfig
from ferry.launcher import free_port
from protos.registry import SchedulerInfo
from router.discovery import SchedulerDirectory
from router.limits import KeyLimiter, KeyLimits, OverLimit
from scheduler.__main__ import build_parser, check_exposure
from scheduler.registry import Registry
from tests.conftest import make_pki
from tests.services_fixtures import wait_until

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
        wait_until(lambda: redis_answers(url), "TLS Redis up")
        asyncio.run(register_and_discover(url))
    finally:
        server.kill()
        server.wait()


def redis_answers(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, password=REDIS_PASSWORD).ping()
    except redis.ConnectionError:
        return False


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
