"""A stand-in for an accelerator's scheduler: speaks the real `Scheduler.Connect` contract and registers in Redis
like a real scheduler, but computes nothing. Every `--step-interval` seconds it emits one token for each of up to
`--batch` running requests (one ConnectResponse per Connect stream per step, as the real one does), so the router
in front of it sees a GPU's token rate on a machine without one.

    ferry bench synthetic-scheduler --port P --redis-url URL --model-path DIR [--step-interval 0.01] [--batch 256]
        [--send-log FILE]

Each emitted token is a single-character token of the model's tokenizer, so a client can count tokens in text.
With --send-log, on SIGTERM it writes {request_id: [send time of token 0, 1, ...]} (time.time()) as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid
from dataclasses import dataclass, field

import grpc
from tokenizers import Tokenizer

from base import environment, event_loop
from benchmarks.common.cli_args import bench_parser
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from protos.registration import SchedulerInfo
from scheduler.presence import Registry

SINGLE_CHARACTERS = "abcdefghijklmnopqrstuvwxyz"


def single_character_tokens(model_path: str) -> list[int]:
    """Token ids that each decode to one letter, whatever surrounds them."""
    tokenizer = Tokenizer.from_file(f"{model_path}/tokenizer.json")
    ids = [tokenizer.token_to_id(c) for c in SINGLE_CHARACTERS]
    return [i for i in ids if i is not None]


@dataclass
class Running:
    request_id: str
    max_tokens: int
    stream: asyncio.Queue
    emitted: int = 0
    sent_at: list[float] = field(default_factory=list)


@dataclass
class SyntheticScheduler(scheduler_pb2_grpc.SchedulerServicer):
    token_ids: list[int]
    step_interval: float
    batch: int
    running: dict[str, Running] = field(default_factory=dict)
    waiting: list[Running] = field(default_factory=list)
    send_log: dict[str, list[float]] = field(default_factory=dict)
    steps: int = 0
    connects: int = 0   # Connect streams opened: one per router process that sent a request

    async def Connect(self, request_iterator, context):
        self.connects += 1
        outgoing: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self.read(request_iterator, outgoing))
        try:
            while True:
                message = await outgoing.get()
                if message is None:
                    return
                await context.write(message)
        finally:
            reader.cancel()

    async def read(self, request_iterator, outgoing: asyncio.Queue) -> None:
        async for message in request_iterator:
            if message.HasField("abort"):
                self.abort(message.abort.request_id)
                continue
            request = message.submit.request
            sampling = request.sampling
            self.waiting.append(Running(request.request_id,
                                        sampling.max_tokens if sampling.HasField("max_tokens") else 16, outgoing))
        outgoing.put_nowait(None)

    def abort(self, request_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        aborted = self.running.pop(request_id, None)
        if aborted is not None:
            self.send_log[request_id] = aborted.sent_at

    async def Stats(self, request, context):
        return scheduler_pb2.StatsResponse(scheduler_id="synthetic", num_running=len(self.running),
                                           num_waiting=len(self.waiting), block_size=16, num_steps=self.steps)

    async def run(self) -> None:
        next_step = time.monotonic()
        while True:
            next_step += self.step_interval
            await asyncio.sleep(max(0.0, next_step - time.monotonic()))
            self.step()

    def step(self) -> None:
        """One engine step: admit waiting requests up to the batch, one token for each running one."""
        while self.waiting and len(self.running) < self.batch:
            admitted = self.waiting.pop(0)
            self.running[admitted.request_id] = admitted
        messages: dict[int, tuple[asyncio.Queue, scheduler_pb2.ConnectResponse]] = {}
        now = time.time()
        for request in list(self.running.values()):
            queue, message = messages.setdefault(id(request.stream),
                                                 (request.stream, scheduler_pb2.ConnectResponse()))
            output = message.events.add(request_id=request.request_id).output
            output.token_ids.append(self.token_ids[request.emitted % len(self.token_ids)])
            if request.emitted == 0:
                output.num_prompt_tokens = 1
            request.emitted += 1
            request.sent_at.append(now)
            if request.emitted >= request.max_tokens:
                output.finish_reason = common_pb2.FINISH_REASON_LENGTH
                self.send_log[request.request_id] = request.sent_at
                del self.running[request.request_id]
        for queue, message in messages.values():
            queue.put_nowait(message)
        self.steps += 1


async def serve(args: argparse.Namespace) -> None:
    scheduler = SyntheticScheduler(single_character_tokens(args.model_path), args.step_interval, args.batch)
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    vocab_size = Tokenizer.from_file(f"{args.model_path}/tokenizer.json").get_vocab_size()
    info = SchedulerInfo(f"synthetic-{uuid.uuid4().hex[:8]}", f"127.0.0.1:{port}", args.model_name,
                         args.model_path, 16, 1 << 20, vocab_size)
    # signed as a real scheduler's is, so that a router given $FERRY_CLUSTER_TOKEN too takes it
    registry = Registry(args.redis_url, lambda: info, cluster_token=environment.FERRY_CLUSTER_TOKEN)
    registry.start()
    stepping = asyncio.create_task(scheduler.run())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"synthetic scheduler serving on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    stepping.cancel()
    if args.send_log:
        with open(args.send_log, "w") as f:
            json.dump(scheduler.send_log, f)
    await server.stop(0)


def main(argv: list[str]) -> int:
    parser = bench_parser("synthetic-scheduler", __doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--model-path", required=True, help="directory with tokenizer.json")
    parser.add_argument("--model-name", default="synthetic")
    parser.add_argument("--step-interval", type=float, default=0.01, help="seconds per engine step")
    parser.add_argument("--batch", type=int, default=256, help="most requests running at once")
    parser.add_argument("--send-log", default="", help="where to write the send times on SIGTERM")
    event_loop.run(serve(parser.parse_args(argv)))
    return 0

