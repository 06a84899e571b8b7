"""A scheduler sent SIGTERM drains: it deregisters, refuses new work, finishes what it runs within the drain
timeout, fails the rest with UNAVAILABLE, and exits zero with its worker."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import grpc
import pytest

from ferry.launcher import free_port, wait_for_health
from ferry.stack import Stack as LauncherStack
from protos import scheduler_pb2_grpc
from tests.services_fixtures import (CHILD_ENV, ConnectStream, ServiceStack, child_pids, greedy, indexed_blocks,
                                     served_alone, start_services, wait_until)

LONG = 400             # tokens: a request that outlasts the moment SIGTERM arrives


@dataclass
class RedisStack:
    """The redis-server the tests' own schedulers register with (and a scheduler and router on it, whose start also
    builds the CPU kernels those schedulers then load)."""
    services: ServiceStack


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    services = start_services(tiny_llama_dir, num_schedulers=1)
    try:
        yield RedisStack(services)
    finally:
        services.stop()


def start_scheduler(model_dir, redis_url: str, *flags: str) -> tuple[subprocess.Popen, str]:
    port, alone = free_port(), LauncherStack()
    process = alone.start([sys.executable, "-m", "scheduler", "--model", str(model_dir), "--dtype", "float32",
                           "--kv-cache-memory", "4000000", "--port", str(port), "--redis-url", redis_url,
                           "--scheduler-id", f"drain-{port}", "--heartbeat-ttl", "30", *flags], "scheduler",
                          env=CHILD_ENV)
    try:
        wait_for_health(f"127.0.0.1:{port}", alone, timeout=180)
    except BaseException:
        alone.stop()   # a scheduler that never got healthy must not outlive the test
        raise
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
