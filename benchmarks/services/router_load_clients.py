"""The client process of `ferry bench router`: streams that keep the router busy for a run's duration over gRPC,
OpenAI SSE or plain OpenAI HTTP, logging when each token arrived.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from base import event_loop
from protos import common_pb2, router_pb2, router_pb2_grpc

PROMPT = [1, 2, 3, 4]
APIS = ("grpc", "sse", "http")


@dataclass
class BenchOptions:
    """One `ferry bench router` run: the services' shape, the clients and the load they put on."""
    model_path: str
    clients: list[int] = field(default_factory=lambda: [64])
    apis: list[str] = field(default_factory=lambda: list(APIS))
    duration: float = 5.0           # seconds of load per run
    max_tokens: int = 128           # per request
    step_interval: float = 0.01
    batch: int = 256
    workers: int = 1
    stream_interval: int = 0        # tokens per message the clients ask for (0: the router's default)


@dataclass
class ClientLog:
    """What one client process saw: each request's receive time per token index, and the messages counted."""
    received: dict[str, list[float]] = field(default_factory=dict)
    messages: int = 0
    failed: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(times) for times in self.received.values())


async def grpc_client(target: str, name: str, deadline: float, options: BenchOptions, log: ClientLog) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        n = 0
        while time.monotonic() < deadline:
            request_id, n = f"{name}-{n}", n + 1
            request = router_pb2.GenerateRequest(
                request_id=request_id, token_ids=router_pb2.TokenIds(ids=PROMPT),
                sampling=common_pb2.SamplingParams(max_tokens=options.max_tokens, temperature=0.0))
            if options.stream_interval:
                request.stream_interval = options.stream_interval
            times = log.received.setdefault(request_id, [])
            try:
                async for response in stub.Generate(request):
                    now = time.time()
                    times.extend([now] * len(response.token_ids))
                    log.messages += 1
            except grpc.aio.AioRpcError:
                log.failed += 1


async def http_client(base_url: str, client: httpx.AsyncClient, deadline: float, options: BenchOptions,
                      stream: bool, log: ClientLog) -> None:
    body = {"prompt": PROMPT, "max_tokens": options.max_tokens, "temperature": 0.0, "stream": stream}
    if options.stream_interval:
        body["stream_interval"] = options.stream_interval
    while time.monotonic() < deadline:
        try:
            if stream:
                await read_sse(client, f"{base_url}/v1/completions", body, log)
            else:
                response = await client.post(f"{base_url}/v1/completions", json=body)
                response.raise_for_status()
                answer = response.json()
                log.received[answer["id"]] = [time.time()] * len(answer["choices"][0]["text"])
                log.messages += 1
        except httpx.HTTPError:
            log.failed += 1


async def read_sse(client: httpx.AsyncClient, url: str, body: dict, log: ClientLog) -> None:
    """Each token is one character of text (the synthetic scheduler's), so characters count tokens."""
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.time()
            chunk = json.loads(line[6:])
            log.received.setdefault(chunk["id"], []).extend([now] * len(chunk["choices"][0]["text"]))
            log.messages += 1


async def run_clients(api: str, grpc_target: str, base_url: str, num_clients: int, options: BenchOptions,
                      run_name: str) -> ClientLog:
    log = ClientLog()
    deadline = time.monotonic() + options.duration
    if api == "grpc":
        await asyncio.gather(*(grpc_client(grpc_target, f"{run_name}-{c}", deadline, options, log)
                               for c in range(num_clients)))
        return log
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as client:
        await asyncio.gather(*(http_client(base_url, client, deadline, options, api == "sse", log)
                               for _ in range(num_clients)))
    return log


def client_process(api: str, grpc_target: str, base_url: str, num_clients: int, options: BenchOptions,
                   run_name: str, ready, results) -> None:
    ready.set()
    log = event_loop.run(run_clients(api, grpc_target, base_url, num_clients, options, run_name))
    results.put((log.received, log.messages, log.failed))
