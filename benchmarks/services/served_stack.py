"""`ferry up` as a subprocess for benchmarks: started, read until its ready line, stopped with SIGTERM."""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import grpc

from ferry.launcher import free_port

READY_TIMEOUT_S = 600.0
READY = re.compile(r"^\[ferry\] ready: router gRPC (\S+) .*· redis (\S+) · schedulers (.+?) · model ")
STARTED = re.compile(r"^\[ferry\] started (redis-server|router|scheduler \d+).* \(pid (\d+)\)")


class ServedStack:
    """`ferry up` as a subprocess: started, read until its ready line (its output kept for errors), stopped."""

    def __init__(self, up_args: list[str], env: dict[str, str] | None = None):
        port = free_port()
        self.cluster_token, self.redis_password = secrets.token_hex(16), secrets.token_hex(16)   # for direct calls
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ferry.cli", "up", "--port", str(port), "--http-port", "0", *up_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={"FERRY_LOG_LEVEL": "WARNING", **os.environ,   # quiet, unless the caller's environment says
                 "FERRY_CLUSTER_TOKEN": self.cluster_token, "FERRY_REDIS_PASSWORD": self.redis_password,
                 **(env or {})})
        self.output: deque[str] = deque(maxlen=60)
        self.ready = threading.Event()
        self.router = ""
        self.redis_url = ""
        self.schedulers: list[str] = []
        self.pids: dict[str, int] = {}      # "redis-server", "router", "scheduler 0", ...: the latest started
        self.channels: dict[str, grpc.Channel] = {}
        threading.Thread(target=self.read_output, daemon=True).start()

    def read_output(self) -> None:
        for line in self.process.stdout:    # drained to the end, or the stack would block on a full pipe
            self.output.append(line.rstrip())
            started = STARTED.match(line)
            if started:
                self.pids[started.group(1)] = int(started.group(2))
            match = READY.match(line)
            if match:
                self.router, self.redis_url = match.group(1), match.group(2)
                self.schedulers = [a.strip() for a in match.group(3).split(",")]
                self.ready.set()

    def wait_ready(self, num_schedulers: int, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ferry up did not get ready:\n" + "\n".join(self.output))
        wait_registered(self.redis_url, self.redis_password, num_schedulers)

    @property
    def channel(self) -> grpc.Channel:
        """To the router."""
        return self.channel_to(self.router)

    def channel_to(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address)
        return self.channels[address]

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)   # ferry up stops its own stack
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:   # each service is a session of its own: ferry up's group is not theirs
                for pid in [self.process.pid, *self.pids.values()]:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> ServedStack:
        return self

    def __exit__(self, *_) -> None:
        self.stop()


def wait_registered(redis_url: str, password: str, num_schedulers: int, timeout: float = 30.0) -> None:
    """Every scheduler in Redis, and one router refresh later, so the first request can go to any of them."""
    import redis

    client = redis.Redis.from_url(redis_url, password=password)
    deadline = time.monotonic() + timeout
    while len(list(client.scan_iter(match="ferry:scheduler:*"))) < num_schedulers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{num_schedulers} schedulers did not register in {timeout:.0f}s")
        time.sleep(0.1)
    client.close()
    time.sleep(1.0)
