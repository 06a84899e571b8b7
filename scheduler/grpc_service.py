"""The Scheduler gRPC service over the engine loop (scheduler/engine_loop.py): Connect, one bidirectional stream
per router that carries many requests and sends each step's outputs for all of them as one message (gRPC's cost
is per message), and Stats.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from opentelemetry.context import Context

from base.errors import StatusError
from base.grpc_options import MAX_MESSAGE_BYTES
from base.sampling_params import SamplingParams
from base.telemetry import extract_metadata
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from protos.finish_reasons import FINISH_REASON_TO_PROTO
from scheduler.admission import QueueFull
from scheduler.core import RequestOutput
from scheduler.engine_loop import Draining, EngineLoop, RequestStream
from scheduler.lora_adapters import AdapterNotFound
from scheduler.sequence import Tenancy
from scheduler.worker_process import WorkerFailed


def to_response(out: RequestOutput, first: bool) -> scheduler_pb2.ScheduleResponse:
    response = scheduler_pb2.ScheduleResponse(index=out.index, token_ids=out.new_token_ids,
                                              logprobs=out.new_logprobs,
                                              finish_reason=FINISH_REASON_TO_PROTO[out.finish_reason])
    if out.stop_token_id is not None:
        response.stop_token_id = out.stop_token_id
    if first:
        response.num_prompt_tokens = out.num_prompt_tokens
        response.num_cached_tokens = out.num_cached_tokens
    if out.prompt_logprobs is not None:
        response.prompt_logprobs.extend(out.prompt_logprobs)
    if out.embedding is not None:
        response.embedding.extend(out.embedding)
    return response


def response_for(stream: RequestStream, item: RequestOutput) -> scheduler_pb2.ScheduleResponse:
    """What an output of the stream's request becomes on the wire; marks the sample it ends."""
    response = to_response(item, not stream.sent_first)
    stream.sent_first = True
    if item.finish_reason is not None:
        stream.finished.add(item.index)
    return response


def admit(loop: EngineLoop, request_id: str, request: scheduler_pb2.ScheduleRequest, outputs: asyncio.Queue,
          trace_parent: Context | None) -> RequestStream:
    try:
        params = SamplingParams.from_proto(request.sampling)
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)   # its own: a part of the request would keep all of it (the prompt) alive
        tenancy = Tenancy(request.tenant, request.priority, request.tenant_weight or 1.0, request.cache_salt)
        return loop.add_request(request_id, list(request.prompt_token_ids), params, outputs, trace_parent,
                                list(request.resumed_token_ids), sampling, tenancy, request.lora_name,
                                request.kv_source if request.HasField("kv_source") else None)
    except AdapterNotFound as e:
        raise StatusError(grpc.StatusCode.NOT_FOUND, str(e)) from e
    except ValueError as e:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
    except QueueFull as e:
        raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
    except (WorkerFailed, Draining) as e:
        raise StatusError(grpc.StatusCode.UNAVAILABLE, str(e)) from e


CLIENT_DONE = object()   # queued on a connection when its client sent its last message
# a message of merged outputs ends once it holds this much: the rest go in the next (router and scheduler agree on
# MAX_MESSAGE_BYTES; half of it leaves room for one output past the mark)
SPLIT_MESSAGE_BYTES = MAX_MESSAGE_BYTES // 2


class Connection:
    """The requests of one Connect stream. Their outputs share one queue, so everything the loop delivered in a
    step (and whatever piled up while the last message was being written) goes out as one ConnectResponse, or as
    several where one would pass split_bytes."""

    def __init__(self, loop: EngineLoop, split_bytes: int = SPLIT_MESSAGE_BYTES):
        self.loop = loop
        self.split_bytes = split_bytes
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.live: dict[str, RequestStream] = {}
        self.client_done = False

    async def read(self, messages: AsyncIterator[scheduler_pb2.ConnectRequest]) -> None:
        try:
            async for message in messages:
                if message.HasField("submit"):
                    self.submit(message.submit)
                elif message.HasField("abort"):
                    self.abort(message.abort.request_id)
        finally:
            self.outputs.put_nowait((None, CLIENT_DONE))

    def submit(self, submit: scheduler_pb2.SubmitRequest) -> None:
        request_id = submit.request.request_id
        try:
            if not request_id:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a request on a Connect stream needs a request_id")
            if request_id in self.live:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request_id!r} is already in use")
            trace_parent = extract_metadata(submit.trace_context.items())
            self.live[request_id] = admit(self.loop, request_id, submit.request, self.outputs, trace_parent)
        except StatusError as e:
            RequestStream(request_id, 0, self.outputs).put(e)   # a stream of its own: never live here

    def abort(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.loop.abort(request_id)

    def close(self) -> None:
        """The stream is gone: nobody reads what its requests would produce."""
        for request_id in list(self.live):
            self.abort(request_id)

    @property
    def ended(self) -> bool:
        return self.client_done and not self.live

    async def next_message(self) -> scheduler_pb2.ConnectResponse:
        message = scheduler_pb2.ConnectResponse()
        self.add_events(message, *await self.outputs.get())
        size = message.ByteSize()
        while not self.outputs.empty() and size < self.split_bytes:
            num_events = len(message.events)
            self.add_events(message, *self.outputs.get_nowait())
            size += sum(event.ByteSize() for event in message.events[num_events:])
        return message

    def add_events(self, message: scheduler_pb2.ConnectResponse, stream: RequestStream | None, item) -> None:
        if item is CLIENT_DONE:
            self.client_done = True
        elif isinstance(item, Exception):
            code, reason = ((item.code, item.message) if isinstance(item, StatusError)
                            else (grpc.StatusCode.UNAVAILABLE, str(item)))
            message.events.add(request_id=stream.request_id,
                               error=scheduler_pb2.RequestFailure(code=code.value[0], message=reason))
            self.forget(stream)
        elif self.live.get(stream.request_id) is stream:   # else aborted by this client: nothing more goes out
            message.events.add(request_id=stream.request_id, output=response_for(stream, item))
            if stream.done:
                self.forget(stream)

    def forget(self, stream: RequestStream) -> None:
        if self.live.get(stream.request_id) is stream:
            del self.live[stream.request_id]
            self.loop.streams.pop(stream.request_id, None)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop, scheduler_id: str):
        self.loop = loop
        self.scheduler_id = scheduler_id

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                      context: grpc.aio.ServicerContext):
        connection = Connection(self.loop)
        reader = asyncio.create_task(connection.read(request_iterator))
        try:
            while not connection.ended:
                message = await connection.next_message()
                if message.events:
                    yield message
        finally:
            reader.cancel()
            connection.close()

    async def LoadLoraAdapter(self, request: common_pb2.LoraAdapterRequest, context: grpc.aio.ServicerContext
                              ) -> scheduler_pb2.LoraAdapterResponse:
        try:
            loaded = await self.loop.load_adapter(request.name, request.path)
        except StatusError as e:
            await context.abort(e.code, e.message)
        return scheduler_pb2.LoraAdapterResponse(name=request.name, rank=loaded.rank)

    async def UnloadLoraAdapter(self, request: common_pb2.LoraAdapterRequest, context: grpc.aio.ServicerContext
                                ) -> scheduler_pb2.LoraAdapterResponse:
        try:
            self.loop.unload_adapter(request.name)
        except StatusError as e:
            await context.abort(e.code, e.message)
        return scheduler_pb2.LoraAdapterResponse(name=request.name)

    async def FetchBlocks(self, request: scheduler_pb2.FetchBlocksRequest, context: grpc.aio.ServicerContext):
        if self.loop.kv_server is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this scheduler does not serve its KV")
        try:
            async for chunk in self.loop.kv_server.fetch(request):
                yield chunk
        except StatusError as e:
            await context.abort(e.code, e.message)

    async def Stats(self, request: scheduler_pb2.StatsRequest, context) -> scheduler_pb2.StatsResponse:
        stats = self.loop.load()
        stats.scheduler_id = self.scheduler_id
        return stats
