"""A scheduler whose loop waits on its worker too long (a hung device, a worker being replaced) leaves routing:
it reports NOT_SERVING and leaves the registry until the wait ends, so routers stop sending it requests that
would only queue."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)
HEALTH_SERVICES = ("", "ferry.Scheduler")   # liveness and readiness both say it


@dataclass
class StallWatch:
    stalled_seconds: Callable[[], float]     # EngineLoop.stalled_seconds
    health_servicer: health.aio.HealthServicer
    stall_timeout: float
    stalled: bool = False

    async def run(self, poll_s: float = 0.25) -> None:
        while True:
            await self.check()
            await asyncio.sleep(poll_s)

    async def check(self) -> None:
        waited = self.stalled_seconds()
        stalled = waited > self.stall_timeout
        if stalled == self.stalled:
            return
        self.stalled = stalled
        if stalled:
            log.warning("waiting on the worker for %.1fs (--stall-timeout %gs): NOT_SERVING, out of the registry",
                        waited, self.stall_timeout)
        else:
            log.warning("the worker answered again: SERVING")
        status = health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
        for service in HEALTH_SERVICES:
            await self.health_servicer.set(service, status)
