"""KV blocks moving between schedulers: a scheduler pulls the KV of a prompt's cached prefix from the peer that
holds it (the router names the peer: ScheduleRequest.kv_source) instead of recomputing it.

The holder (KvServer, behind Scheduler.FetchBlocks) checks the caller's layout, pins the leading run of the asked
hashes that it has cached, reads them from its worker in chunks of whole blocks, streams them, and unpins them.
The puller (KvPulls) holds the request out of the queue while it pulls: for each chunk it reserves free blocks, has
its worker write the KV into them, and adopts them into its prefix cache as if computed here; then the request joins
the queue where its arrival puts it (not behind what came during the pull), and its admission finds the pulled
blocks like any cache hit. Where the two share a host (the holder sees the probe file the puller made in /dev/shm
for this pull), a chunk goes as a shared-memory file the holder's worker writes and the puller's worker reads and
removes, not through the three gRPC hops. Any failure (the peer gone, stalled PULL_STALL_S, refusing; the pool full;
the worker restarting) ends the pull where it is: what arrived is kept, the rest is recomputed, and no request
fails. The step loop never waits for a pull, nor the pull for a step: the workers read and write the blocks beside
their steps (gpu_worker/process.py: why that is safe)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from base.cluster_auth import token_metadata
from base.errors import StatusError
from base.grpc_options import GRPC_OPTIONS
from base.tls import TlsConfig
from protos import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from scheduler.worker_process import WorkerFailed

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20     # KV per streamed message (whole blocks): big enough to stream fast, small to pipeline
PULL_STALL_S = 5.0        # a peer that sends nothing for this long is given up on (the rest is recomputed)
MIN_PULL_BLOCKS = 1
SHM_DIR = "/dev/shm"
SHM_PREFIX = "ferry-kv-"
PROBE_PREFIX = "ferry-probe-"
RECUT_FIELDS = ("tensor_parallel_size", "block_bytes")   # what may differ between groups of other sizes
STALE_SHM_S = 120.0       # a chunk or probe file this old lost its owner (a puller died or gave up): removed


def kv_layout(model: worker_pb2.ModelInfo, hash_root: int) -> scheduler_pb2.KvLayout:
    return scheduler_pb2.KvLayout(model_name=model.model_name, dtype=model.kv_dtype, block_size=model.block_size,
                                  num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                                  head_dim=model.head_dim, tensor_parallel_size=model.tensor_parallel_size or 1,
                                  hash_root=hash_root, block_bytes=model.kv_block_bytes,
                                  draft_model_name=model.draft_model_name)


def layout_difference(mine: scheduler_pb2.KvLayout, theirs: scheduler_pb2.KvLayout) -> str:
    """What differs between two layouts, in words ("" where their blocks are interchangeable). Groups of other
    sizes may differ in their ranks' shares (a block's bytes, where KV heads are replicated): the puller's worker
    cuts the heads again (gpu_worker/kv_blocks.py)."""
    recut = mine.tensor_parallel_size != theirs.tensor_parallel_size
    return "; ".join(f"{f.name}: {getattr(theirs, f.name)!r} here {getattr(mine, f.name)!r}"
                     for f in mine.DESCRIPTOR.fields
                     if not (recut and f.name in RECUT_FIELDS) and getattr(mine, f.name) != getattr(theirs, f.name))


@dataclass
class KvTransferCounters:
    pulls: int = 0              # pulls started
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    pull_failures: int = 0      # pulls that ended early (the rest recomputed)
    served_blocks: int = 0      # blocks this scheduler streamed to peers


@dataclass
class KvServer:
    """The holder's side: FetchBlocks."""
    loop: object                # scheduler.engine_loop.EngineLoop
    counters: KvTransferCounters = field(default_factory=KvTransferCounters)

    def layout(self) -> scheduler_pb2.KvLayout:
        return kv_layout(self.loop.info.model, self.loop.scheduler.block_manager.root_hash)

    async def fetch(self, request: scheduler_pb2.FetchBlocksRequest) -> AsyncIterator[scheduler_pb2.KvBlocks]:
        """StatusError FAILED_PRECONDITION where the layouts differ or this scheduler cannot read its blocks."""
        mine = self.layout()
        difference = layout_difference(mine, request.layout)
        if difference:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"KV layouts differ: {difference}")
        if self.loop.restarting or self.loop.failure:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the worker is restarting")
        scheduler = self.loop.scheduler
        manager = scheduler.block_manager
        block_ids = manager.cached_run(list(request.block_hashes))
        shared = shares_memory(request.shm_probe)
        if shared:
            remove_stale_files()
        manager.pin(block_ids)
        try:
            per_chunk = max(1, CHUNK_BYTES // max(1, mine.block_bytes))
            for start in range(0, len(block_ids), per_chunk):
                ids = block_ids[start:start + per_chunk]
                path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{uuid.uuid4().hex}") if shared else ""
                try:
                    data = await self.loop.worker.read_blocks(ids, path)
                except WorkerFailed as e:
                    raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
                self.counters.served_blocks += len(ids)
                yield scheduler_pb2.KvBlocks(block_hashes=request.block_hashes[start:start + len(ids)], data=data,
                                             shm_path=path, tensor_parallel_size=mine.tensor_parallel_size)
        finally:
            if self.loop.scheduler is scheduler:   # a restarted worker's manager never had these pins
                manager.unpin(block_ids)


class KvPulls:
    """The puller's side: a task per request that names a peer, holding the request until its pull ends."""

    def __init__(self, loop, scheduler_id: str, cluster_token: str = "", tls: TlsConfig = TlsConfig(),
                 counters: KvTransferCounters | None = None):
        self.loop = loop
        self.scheduler_id = scheduler_id
        self.metadata = token_metadata(cluster_token)
        self.tls = tls
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.counters = counters or KvTransferCounters()
        remove_stale_files()   # what a killed predecessor on this host left

    def wanted(self, source: scheduler_pb2.KvSource) -> bool:
        return bool(source.address) and source.scheduler_id != self.scheduler_id and source.num_blocks > 0

    def start(self, request_id: str, source: scheduler_pb2.KvSource) -> None:
        """The request is held (Scheduler.add_request(held=True)): pull, then release it to the queue."""
        self.counters.pulls += 1
        self.tasks[request_id] = asyncio.create_task(self.pull(request_id, source))

    async def pull(self, request_id: str, source: scheduler_pb2.KvSource) -> None:
        scheduler = self.loop.scheduler
        started = time.perf_counter()
        try:
            hashes = self.missing_hashes(scheduler, request_id, source.num_blocks)
            if len(hashes) >= MIN_PULL_BLOCKS:
                await self.receive(scheduler, request_id, source, hashes)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, WorkerFailed, ValueError) as e:
            self.counters.pull_failures += 1
            log.warning("KV pull for %s from %s ended early (the rest is recomputed): %s", request_id,
                        source.scheduler_id or source.address, describe(e))
        finally:
            self.counters.pull_seconds += time.perf_counter() - started
            self.tasks.pop(request_id, None)
            if self.loop.scheduler is scheduler:
                scheduler.release_held(request_id)
                self.loop.on_kv_events(*scheduler.drain_kv_events())
                self.loop.wakeup.set()

    @staticmethod
    def missing_hashes(scheduler, request_id: str, num_blocks: int) -> list[int]:
        """The request's reusable leading blocks up to num_blocks, past those already cached here."""
        seq = scheduler.held.get(request_id)
        if seq is None:
            return []
        manager = scheduler.block_manager
        hashes = manager.reusable_hashes(seq)[:num_blocks]
        return hashes[len(manager.cached_run(hashes)):]

    async def receive(self, scheduler, request_id: str, source: scheduler_pb2.KvSource, hashes: list[int]) -> None:
        manager = scheduler.block_manager
        layout = kv_layout(self.loop.info.model, manager.root_hash)
        stub = scheduler_pb2_grpc.SchedulerStub(self.channel(source.address))
        with shm_probe() as probe:
            request = scheduler_pb2.FetchBlocksRequest(block_hashes=hashes, layout=layout, shm_probe=probe)
            await self.read_chunks(scheduler, request_id, stub.FetchBlocks(request, metadata=self.metadata), layout)

    async def read_chunks(self, scheduler, request_id: str, call: grpc.aio.UnaryStreamCall,
                          layout: scheduler_pb2.KvLayout) -> None:
        try:
            while (chunk := await asyncio.wait_for(call.read(), PULL_STALL_S)) is not grpc.aio.EOF:
                try:
                    if not await self.take(scheduler, request_id, chunk):
                        return   # the worker restarted, or the request was aborted: nothing more to do
                finally:
                    remove_chunk_file(chunk.shm_path)   # gone already once its worker read it
                self.counters.pulled_bytes += len(chunk.block_hashes) * layout.block_bytes
        finally:
            call.cancel()

    async def take(self, scheduler, request_id: str, chunk: scheduler_pb2.KvBlocks) -> bool:
        """The chunk's blocks into reserved blocks of the pool, adopted into the prefix cache; False where the pull
        is moot (the worker restarted, or the request is gone)."""
        if self.loop.scheduler is not scheduler or request_id not in scheduler.held:
            return False
        if chunk.shm_path and not is_chunk_file(chunk.shm_path):
            raise ValueError(f"the peer named {chunk.shm_path!r}, not a KV chunk file in {SHM_DIR}")
        manager = scheduler.block_manager
        block_ids = manager.reserve(len(chunk.block_hashes))
        if block_ids is None:
            raise ValueError("the pool has no free blocks for the pulled KV")
        try:
            await self.loop.worker.write_blocks(block_ids, chunk.data, chunk.shm_path, chunk.tensor_parallel_size)
        except BaseException:
            if self.loop.scheduler is scheduler:
                manager.unpin(block_ids)
            raise
        if self.loop.scheduler is not scheduler:
            return False
        manager.adopt(block_ids, list(chunk.block_hashes))
        self.counters.pulled_blocks += len(block_ids)
        return True

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = (
                grpc.aio.secure_channel(address, self.tls.channel_credentials(),
                                        GRPC_OPTIONS + self.tls.channel_options())
                if self.tls.serving else grpc.aio.insecure_channel(address, GRPC_OPTIONS))
        return self.channels[address]

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        for channel in self.channels.values():
            await channel.close()


@contextlib.contextmanager
def shm_probe() -> Iterator[str]:
    """The bare name of a file of ours in /dev/shm, there while the block runs ("" where there is no /dev/shm): a
    holder that sees it shares this host. One pull long, so a killed scheduler leaves only its pulls' in flight,
    which remove_stale_files sweeps."""
    if not os.path.isdir(SHM_DIR):
        yield ""
        return
    handle, path = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=SHM_DIR)
    os.close(handle)
    try:
        yield os.path.basename(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def shares_memory(probe: str) -> bool:
    """Whether the caller's probe file (a bare name) is in this host's /dev/shm: the same host, the same namespace."""
    return bool(probe) and os.path.basename(probe) == probe and os.path.isfile(os.path.join(SHM_DIR, probe))


def is_chunk_file(path: str) -> bool:
    return os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith(SHM_PREFIX)


def remove_chunk_file(path: str) -> None:
    if path and is_chunk_file(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_stale_files() -> None:
    """Chunk and probe files older than STALE_SHM_S: their puller never read or removed them (it died, or gave up on
    the stream)."""
    if not os.path.isdir(SHM_DIR):
        return
    now = time.time()
    for entry in os.scandir(SHM_DIR):
        if entry.name.startswith((SHM_PREFIX, PROBE_PREFIX)):
            try:
                if now - entry.stat().st_mtime > STALE_SHM_S:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass


def describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, asyncio.TimeoutError):
        return f"the peer sent nothing for {PULL_STALL_S:g} s"
    return str(error) or type(error).__name__
