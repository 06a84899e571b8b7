"""`ferry up` starts the whole stack, answers `ferry generate`, and leaves no process behind after SIGTERM."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from ferry.launcher import free_port, wait_for_health
from ferry.stack import Stack
from protos import scheduler_pb2, scheduler_pb2_grpc
from tests.services_fixtures import wait_until

FERRY = str(Path(sys.executable).parent / "ferry")


def processes_with_marker(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def start_ferry_up(*flags: str) -> tuple[subprocess.Popen, str, str]:
    marker = f"FERRY_TEST_MARKER={uuid.uuid4().hex}"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FERRY_LOG_LEVEL": "WARNING", marker.split("=")[0]: marker}
    up = subprocess.Popen([FERRY, "up", "--port", str(port), "--http-port", str(free_port()), "--heartbeat-ttl", "2",
                           *flags], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return up, f"127.0.0.1:{port}", marker


def wait_until_ready(up: subprocess.Popen) -> str:
    lines = []
    for line in up.stdout:
        lines.append(line)
        if line.startswith("[ferry] ready"):
            return "".join(lines)
    raise AssertionError("ferry up exited before it was ready:\n" + "".join(lines))


def ferry_generate(router: str, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([FERRY, "generate", prompt, "--router", router, *flags], capture_output=True,
                          text=True, timeout=120)


def stop_and_check_nothing_left(up: subprocess.Popen, marker: str) -> None:
    assert len(processes_with_marker(marker)) >= 5      # ferry up, redis, 2 schedulers + their workers, router
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=60) == 0
    wait_until(lambda: not processes_with_marker(marker), "every process ferry up started has exited", timeout=10)


def process_secrets(marker: str, name: str) -> tuple[set[str], list[bytes]]:
    """The values of environment variable `name` in the marked processes, and their command lines."""
    values, command_lines = set(), []
    for pid in processes_with_marker(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command_lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
        values |= {v.decode().split("=", 1)[1] for v in environ if v.startswith(f"{name}=".encode())}
    return values, command_lines


def check_closed_to_strangers(banner: str, marker: str) -> None:
    """`ferry up` made the stack's own cluster token and Redis password, kept them off every command line, and its
    schedulers refuse callers without the token, its Redis clients without the password."""
    redis_url, schedulers = re.search(r"· redis (\S+) · schedulers (.+?) · model ", banner).groups()
    for name in ("FERRY_CLUSTER_TOKEN", "FERRY_REDIS_PASSWORD"):
        (value,), command_lines = process_secrets(marker, name)
        assert len(value) >= 32 and not any(value.encode() in line for line in command_lines), name
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(redis_url).ping()
    with grpc.insecure_channel(schedulers.split(",")[0].strip()) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def scheduler_generation_tokens(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("ferry:generation_tokens_total"))


def test_ferry_up_answers_generate_and_leaves_nothing_after_sigterm(tiny_llama_dir):
    metrics_port = free_port()
    up, router, marker = start_ferry_up("--model", str(tiny_llama_dir), "--dtype", "float32",
                                        "--kv-cache-memory", "4000000", "--policy", "round_robin",
                                        "--metrics-port", str(metrics_port))
    try:
        banner = wait_until_ready(up)
        assert router in banner and "redis://" in banner
        result = ferry_generate(router, "Paris is the capital of", "--max-tokens", "8")
        assert result.returncode == 0, result.stderr
        assert "8 completion tokens" in result.stderr
        # each scheduler serves its own /metrics on metrics_port + i; one of them generated the 8 tokens
        assert sum(scheduler_generation_tokens(metrics_port + i) for i in range(2)) == 8
        bad = ferry_generate(router, "", "--max-tokens", "8")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
        check_closed_to_strangers(banner, marker)
        stop_and_check_nothing_left(up, marker)
    finally:
        if up.poll() is None:
            up.kill()


def started_pids(banner: str) -> dict[str, int]:
    """The pid of each process `ferry up` started, by name ("scheduler 0", "redis-server", ...)."""
    return {name: int(pid) for name, pid in re.findall(r"\[ferry\] started (redis-server|scheduler \d+|router)"
                                                       r".*? \(pid (\d+)\)", banner)}


def test_ferry_up_restarts_a_killed_scheduler_and_redis_while_the_rest_keeps_serving(tiny_llama_dir):
    up, router, marker = start_ferry_up("--model", str(tiny_llama_dir), "--dtype", "float32",
                                        "--kv-cache-memory", "4000000", "--policy", "round_robin")
    try:
        banner = wait_until_ready(up)
        pids = started_pids(banner)
        killed_address = re.search(r"started scheduler 0 on (\S+)", banner).group(1)
        os.kill(pids["scheduler 0"], signal.SIGKILL)
        os.kill(pids["redis-server"], signal.SIGKILL)
        served = ferry_generate(router, "Paris is the capital of", "--max-tokens", "4")   # by scheduler 1
        assert served.returncode == 0, served.stderr
        wait_for_health(killed_address, Stack(), timeout=120)        # scheduler 0 is back on its port
        for _ in range(2):                                           # round robin: each scheduler answers one
            result = ferry_generate(router, "Paris is the capital of", "--max-tokens", "4")
            assert result.returncode == 0, result.stderr
        assert up.poll() is None
        stop_and_check_nothing_left(up, marker)
        printed = up.stdout.read()
        for name in ("scheduler 0", "redis-server"):
            assert f"(pid {pids[name]}) exited with code -9; restarting it in" in printed
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.slow
def test_ferry_up_with_the_default_model_says_paris():
    up, router, marker = start_ferry_up("--kv-cache-memory", "50000000")
    try:
        wait_until_ready(up)
        result = ferry_generate(router, "What is the capital of France?", "--chat", "--max-tokens", "24")
        assert result.returncode == 0, result.stderr
        assert "Paris" in result.stdout
        stop_and_check_nothing_left(up, marker)
    finally:
        if up.poll() is None:
            up.kill()


SERVICE_THAT_NEEDS_REDIS_ON_EXIT = """
import os, signal, sys, time
def on_term(*_):
    time.sleep(0.5)   # draining, then deregistering
    try:
        os.kill(int(sys.argv[1]), 0)
        print("redis alive at exit", flush=True)
    except ProcessLookupError:
        print("redis gone at exit", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
"""


def test_stop_keeps_redis_up_until_the_services_have_exited():
    stack = Stack()
    redis_stand_in = stack.start([sys.executable, "-c", "import time; time.sleep(60)"], "redis stand-in",
                                 stops_last=True)
    service = stack.start([sys.executable, "-c", SERVICE_THAT_NEEDS_REDIS_ON_EXIT, str(redis_stand_in.pid)], "service",
                          stdout=subprocess.PIPE, text=True)
    assert service.stdout.readline().strip() == "ready"
    stack.stop(timeout=10)
    assert service.stdout.read().strip() == "redis alive at exit"
    assert redis_stand_in.poll() is not None


@pytest.mark.parametrize("flags, error", [
    (["--speculative-config", '{"method": "eagle"}'], "speculative_config.method: 'eagle' is not supported"),
    (["--tenant-config", '{"tenants": {"a": {"weight": -1}}}'], "tenants.a: weight must be positive"),
    (["--scheduling-policy", "lottery"], "invalid choice: 'lottery'"),
    (["--lora-modules", "a=/x"], "lora_modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "nameonly"], "lora_modules: expected NAME=PATH, got 'nameonly'"),
])
def test_a_bad_engine_flag_stops_ferry_up_before_any_process_starts(flags, error):
    marker = f"FERRY_TEST_MARKER={uuid.uuid4().hex}"
    done = subprocess.run([FERRY, "up", *flags], capture_output=True,
                          text=True, timeout=60, env={**os.environ, marker.split("=")[0]: marker.split("=")[1]})
    assert done.returncode == 2
    assert error in done.stderr
    assert not processes_with_marker(marker)
