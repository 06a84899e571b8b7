"""`python -m router --workers N` (issue 21): N router processes serve behind one gRPC and one HTTP address."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx

from benchmarks.synthetic_scheduler import SyntheticScheduler, single_character_tokens
from ferry.launcher import free_port
from protos import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2_grpc
from router.workers import children_of, worker_argv

NUM_TOKENS = 6


class SchedulerThread:
    """A synthetic scheduler serving from its own event loop on a thread."""

    def __init__(self, tokenizer_dir: str):
        self.scheduler = SyntheticScheduler(single_character_tokens(tokenizer_dir), 0.002, 64)
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.serve(),), daemon=True)
        self.thread.start()
        assert self.started.wait(10)

    async def serve(self) -> None:
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.scheduler, server)
        server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        self.started.set()
        await self.scheduler.run()


def test_worker_argv_drops_only_the_workers_flag():
    assert worker_argv(["--port", "5", "--workers", "2", "--http-port=8"]) == ["--port", "5", "--http-port=8"]
    assert worker_argv(["--workers=3", "--policy", "random"]) == ["--policy", "random"]


def test_two_router_processes_serve_behind_one_address(tokenizer_dir):
    scheduler = SchedulerThread(tokenizer_dir)
    port, http_port = free_port(), free_port()
    router = subprocess.Popen([sys.executable, "-m", "router", "--workers", "2", "--port", str(port),
                               "--http-port", str(http_port), "--scheduler", f"127.0.0.1:{scheduler.port}",
                               "--model-path", tokenizer_dir, "--log-level", "WARNING"])
    try:
        wait_for_health(f"http://127.0.0.1:{http_port}", router)
        assert len(children_of(router.pid)) == 2
        texts = [http_completion(http_port) for _ in range(12)] + [grpc_completion(port) for _ in range(12)]
        assert texts == ["abcdef"] * 24
        assert scheduler.scheduler.connects == 2   # each worker served requests on its own Connect stream
    finally:
        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0


def wait_for_health(base_url: str, router: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert router.poll() is None, "the router exited"
        try:
            healthy = [httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200 for _ in range(8)]
            if all(healthy):   # new connections each: both workers answer
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the router did not become healthy")


def http_completion(http_port: int) -> str:
    body = {"prompt": [5, 6, 7], "max_tokens": NUM_TOKENS}   # a new connection each time
    response = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=30.0)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def grpc_completion(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:   # a new connection each time
        request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]),
                                             sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS))
        return "".join(r.text for r in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=30.0))
