"""`ferry bench grpc-stream-cost`: what Python gRPC itself costs per streamed message, with no Ferry code: the
floor under the router's and the load generator's CPU per token in `ferry bench split`.

    ferry bench grpc-stream-cost [--streams 64] [--messages 200] [--interval 0.02] [--json]

A grpc.aio server (its own process, like the router) holds `--streams` server-streaming calls from one grpc.aio
client (like the load generator) and, every `--interval` seconds (one engine step), puts one small message on
each: the pattern of a decode step at batch `--streams`. Reports each side's CPU seconds per message, read from
/proc around the run.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time

import grpc

from benchmarks.common.cli_args import bench_parser
from ferry.launcher import free_port

SERVICE, METHOD = "ferry.bench.Stream", "Tokens"
MESSAGE = b"x" * 32   # about a GenerateResponse carrying one token and its text


def serve(port: int, messages: int, interval: float, ready) -> None:
    async def main() -> None:
        queues: list[asyncio.Queue] = []

        async def tokens(request: bytes, context):
            queue: asyncio.Queue = asyncio.Queue()
            queues.append(queue)
            for _ in range(messages):
                yield await queue.get()

        async def steps() -> None:
            while True:
                await asyncio.sleep(interval)
                for queue in queues:
                    queue.put_nowait(MESSAGE)

        handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.unary_stream_rpc_method_handler(tokens)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ticker = asyncio.create_task(steps())
        ready.set()
        await server.wait_for_termination()
        ticker.cancel()

    asyncio.run(main())


async def receive(port: int, streams: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(f"/{SERVICE}/{METHOD}")

        async def one() -> int:
            return sum([1 async for _ in call(b"")])

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(streams: int, messages: int, interval: float) -> dict:
    port, ready = free_port(), multiprocessing.Event()
    server = multiprocessing.Process(target=serve, args=(port, messages, interval, ready), daemon=True)
    server.start()
    try:
        ready.wait(30)
        client_before, server_before = process_cpu_seconds(os.getpid()), process_cpu_seconds(server.pid)
        started = time.perf_counter()
        received = asyncio.run(receive(port, streams))
        seconds = time.perf_counter() - started
        client_cpu = process_cpu_seconds(os.getpid()) - client_before
        server_cpu = process_cpu_seconds(server.pid) - server_before
    finally:
        server.terminate()
        server.join()
    return {"streams": streams, "messages": received, "seconds": round(seconds, 2),
            "server_us_per_message": round(server_cpu / received * 1e6, 1),
            "client_us_per_message": round(client_cpu / received * 1e6, 1)}


def main(argv: list[str]) -> int:
    parser = bench_parser("grpc-stream-cost", __doc__, json_output=True)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--messages", type=int, default=200, help="per stream")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between rounds of messages")
    args = parser.parse_args(argv)
    result = measure(args.streams, args.messages, args.interval)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['messages']} messages on {result['streams']} streams in {result['seconds']} s: "
              f"server {result['server_us_per_message']} us, client {result['client_us_per_message']} us "
              "of CPU per message")
    return 0

