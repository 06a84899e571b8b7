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

from benchmarks.services.synthetic_scheduler import SyntheticScheduler, single_character_tokens
from ferry.launcher import free_port
from protos import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2_grpc
from router.workers import children_of, supervise, worker_argv

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


# A worker that, on SIGTERM, takes `delay` seconds to exit 0 with the default SIGTERM handler back in place (as a
# router is once its event loop has closed): a second SIGTERM in that window would kill it.
EXITING_WORKER = """
import pathlib, signal, sys, time
def on_term(*_):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep({delay})
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path({ready!r}).touch()
while True:
    time.sleep(1)
"""

SUPERVISOR = "import sys; from router.workers import supervise; sys.exit(supervise({commands!r}))"


def test_supervisor_signals_each_worker_once_so_a_clean_exit_stays_clean(tmp_path):
    ready = [tmp_path / "fast", tmp_path / "slow"]
    commands = [[sys.executable, "-c", EXITING_WORKER.format(delay=delay, ready=str(path))]
                for delay, path in zip((0.0, 2.0), ready)]
    parent = subprocess.Popen([sys.executable, "-c", SUPERVISOR.format(commands=commands)])
    deadline = time.monotonic() + 30
    while not all(path.exists() for path in ready):
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(30) == 0


def test_supervisor_exits_with_a_failed_workers_status():
    commands = [[sys.executable, "-c", "import time; time.sleep(60)"], [sys.executable, "-c", "raise SystemExit(3)"]]
    assert supervise(commands) == 3


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
