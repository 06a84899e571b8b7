"""A synthetic scheduler (benchmarks/services/synthetic_scheduler.py) served on a free port, in a Router's directory:
the router's code against a scheduler that answers instantly with known tokens."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from benchmarks.services.synthetic_scheduler import SyntheticScheduler, single_character_tokens
from protos import scheduler_pb2_grpc
from router.discovery import SchedulerDirectory


@asynccontextmanager
async def synthetic_scheduler(tokenizer_dir: str, step_interval: float = 0.002
                              ) -> AsyncIterator[tuple[SchedulerDirectory, grpc.aio.Server]]:
    """Yields a directory holding one synthetic scheduler stepping every step_interval, and its server."""
    scheduler = SyntheticScheduler(single_character_tokens(tokenizer_dir), step_interval, 8)
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stepping = asyncio.create_task(scheduler.run())
    directory = SchedulerDirectory(static_addresses=[f"127.0.0.1:{port}"], static_model_path=tokenizer_dir)
    await directory.start()
    try:
        yield directory, server
    finally:
        stepping.cancel()
        await directory.close()
        await server.stop(0)
