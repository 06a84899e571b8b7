"""LoRA adapters loaded and unloaded at run time (vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter):
the router asks every live scheduler to load (or unload) the adapter, and counts it in its own view of those that
did at once (SchedulerDirectory.adapter_changed), so that a request sent right after the answer finds it, however
old the registrations it reads next."""
from __future__ import annotations

import asyncio
import logging

import grpc

from base.errors import StatusError
from protos import common_pb2, scheduler_pb2_grpc
from protos.registration import SchedulerInfo
from router.discovery import SchedulerDirectory

log = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 60.0   # reading an adapter from disk and checking it: seconds for a large one


class LoraAdmin:
    def __init__(self, directory: SchedulerDirectory):
        self.directory = directory

    async def load(self, name: str, path: str) -> int:
        """How many schedulers loaded it; StatusError with a scheduler's reason where one did not (the others
        keep it: loading it again there says ALREADY_EXISTS)."""
        done, failed = await self.on_every_scheduler("LoadLoraAdapter", name, path)
        for info in done:
            self.directory.adapter_changed(info.scheduler_id, name, loaded=True)
        if failed:
            raise partial_failure("loaded", name, done, failed)
        return len(done)

    async def unload(self, name: str) -> int:
        """How many schedulers unloaded it; NOT_FOUND where none had it."""
        done, failed = await self.on_every_scheduler("UnloadLoraAdapter", name, "")
        for info in done:
            self.directory.adapter_changed(info.scheduler_id, name, loaded=False)
        failed = {i: e for i, e in failed.items() if e.code() != grpc.StatusCode.NOT_FOUND}
        if not done and not failed:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded")
        if failed:
            raise partial_failure("unloaded", name, done, failed)
        return len(done)

    async def on_every_scheduler(self, method: str, name: str, path: str
                                 ) -> tuple[list[SchedulerInfo], dict[str, grpc.aio.AioRpcError]]:
        schedulers = self.directory.schedulers()
        if not schedulers:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "no scheduler is available")
        request = common_pb2.LoraAdapterRequest(name=name, path=path)

        async def call(info: SchedulerInfo):
            stub = scheduler_pb2_grpc.SchedulerStub(self.directory.channel(info.address))
            return await getattr(stub, method)(request, timeout=ADMIN_TIMEOUT_S, metadata=self.directory.call_metadata)
        results = await asyncio.gather(*(call(info) for info in schedulers), return_exceptions=True)
        done, failed = [], {}
        for info, result in zip(schedulers, results):
            if isinstance(result, grpc.aio.AioRpcError):
                failed[info.scheduler_id] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                done.append(info)
        log.info("LoRA adapter %s: %s on %d of %d schedulers", name, method, len(done), len(schedulers))
        return done, failed


def partial_failure(verb: str, name: str, done: list[SchedulerInfo], failed: dict[str, grpc.aio.AioRpcError]
                    ) -> StatusError:
    """The first refusal's code and reason, saying on how many schedulers it went through nonetheless."""
    error = next(iter(failed.values()))
    where = f" ({verb} on {len(done)} of {len(done) + len(failed)} schedulers)" if done else ""
    return StatusError(error.code(), f"LoRA adapter {name!r}: {error.details()}{where}")
