"""The scheduler's co-located worker: spawned as a child process serving gpu_worker on a unix socket in a
private temp dir, stepped over gRPC, stopped (or replaced after a failure) by the engine loop."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile

import grpc

from base.config import EngineConfig, init_request
from base.errors import StatusError
from base.grpc_options import GRPC_OPTIONS
from base.health import NotServing, wait_until_serving
from protos import common_pb2, worker_pb2, worker_pb2_grpc

WORKER_START_TIMEOUT_S = 300.0


class WorkerFailed(Exception):
    pass


class WorkerProcess:
    """One worker child process and the channel to it; start() again after stop() gives a fresh one."""

    def __init__(self) -> None:
        self.dir = ""
        self.process: subprocess.Popen | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: worker_pb2_grpc.WorkerStub | None = None

    async def start(self, config: EngineConfig) -> worker_pb2.InitResponse:
        self.dir = tempfile.mkdtemp(prefix="ferry-worker-")
        socket_path = os.path.join(self.dir, "worker.sock")
        self.process = subprocess.Popen([sys.executable, "-m", "gpu_worker", "--socket", socket_path,
                                         "--parent-pid", str(os.getpid())])
        address = f"unix:{socket_path}"
        try:
            await asyncio.to_thread(wait_until_serving, address, self.why_exited, WORKER_START_TIMEOUT_S)
        except NotServing as e:
            raise WorkerFailed(str(e)) from e
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        return await self.stub.Init(init_request(config))

    def why_exited(self) -> str | None:
        if self.process.poll() is None:
            return None
        return f"worker exited with code {self.process.returncode} while starting"

    async def step(self, step: worker_pb2.StepRequest, timeout: float | None = None) -> worker_pb2.StepResult:
        try:
            return await self.stub.Step(step, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.process.poll() is None:
                self.process.kill()   # hung (a device that stopped answering): no use asking it to exit
            raise WorkerFailed(f"worker step failed: {e.code().name}: {e.details()}") from e

    async def interrupt(self, step_id: int) -> None:
        """Ask the worker to cut step step_id short (its result then says interrupted, unless it ran to its end);
        a worker that does not answer is the step's call to find out."""
        try:
            await self.stub.Interrupt(worker_pb2.InterruptRequest(step_id=step_id))
        except grpc.aio.AioRpcError:
            pass

    async def load_adapter(self, name: str, path: str) -> worker_pb2.LoadAdapterResponse:
        """StatusError INVALID_ARGUMENT with the worker's reason when it refuses the adapter."""
        try:
            return await self.stub.LoadAdapter(common_pb2.LoraAdapterRequest(name=name, path=path))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, e.details()) from e
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the worker did not load the adapter: {e.details()}") from e

    async def read_blocks(self, block_ids: list[int], shm_path: str = "") -> bytes:
        """The blocks' KV (or b"", written to the file shm_path); WorkerFailed where the worker cannot (gone, or
        refusing: FAILED_PRECONDITION with the reason)."""
        request = worker_pb2.ReadBlocksRequest(block_ids=block_ids, shm_path=shm_path)
        return (await self.blocks_call(self.stub.ReadBlocks, request)).data

    async def write_blocks(self, block_ids: list[int], data: bytes, shm_path: str = "",
                           source_tensor_parallel_size: int = 0) -> None:
        """source_tensor_parallel_size: the holder's ranks, whose shares the data is (0: as many as here)."""
        request = worker_pb2.WriteBlocksRequest(block_ids=block_ids, data=data, shm_path=shm_path,
                                                source_tensor_parallel_size=source_tensor_parallel_size)
        await self.blocks_call(self.stub.WriteBlocks, request)

    async def blocks_call(self, method, request):
        try:
            return await method(request)
        except grpc.aio.AioRpcError as e:
            raise WorkerFailed(f"worker {type(request).__name__}: {e.code().name}: {e.details()}") from e

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
