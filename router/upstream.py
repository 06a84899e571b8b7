"""The router's side of Scheduler.Connect: one long-lived stream per scheduler carries every request the router
sends there. Submits and aborts go up; each message coming down holds one engine step's outputs for many
requests, which a reader task hands to each request's own queue. A broken stream fails the requests on it
(UNAVAILABLE) and the next submit opens a fresh one.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from base.errors import StatusError
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc

STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
CLOSE = None   # ends a stream's outgoing messages


class UpstreamError(StatusError):
    """How a request ended on the scheduler's side, as a gRPC status; `connection_lost` when the Connect stream
    itself broke (the scheduler may be gone), rather than the scheduler failing this request."""

    def __init__(self, code: grpc.StatusCode, message: str, connection_lost: bool = False):
        super().__init__(code, message)
        self.connection_lost = connection_lost


class UpstreamRequest:
    """One request on a SchedulerConnection: iterate it for the scheduler's ScheduleResponses; close it when done
    with it (an unfinished request is then aborted upstream).

    Each sample's tokens that arrived while the reader was busy come out merged into one response, so a reader
    slower than the scheduler (a client falling behind) gets what it missed in one message, not one per step.
    Set `min_tokens` (the client's stream_interval) to hold a sample's tokens until there are that many, or it
    finished."""

    def __init__(self, connection: SchedulerConnection, request_id: str, num_samples: int):
        self.connection = connection
        self.request_id = request_id
        self.num_samples = num_samples
        self.min_tokens = 1
        self.pending: dict[int, scheduler_pb2.ScheduleResponse] = {}   # by sample index, merged as they arrive
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future | None = None   # set while the request's reader waits for outputs
        self.finished: set[int] = set()
        self.ready: list[scheduler_pb2.ScheduleResponse] = []   # taken from pending, not yet handed out

    @property
    def ended(self) -> bool:
        """Nothing more will come from the scheduler: every sample finished, or the request failed."""
        return self.error is not None or len(self.finished) == self.num_samples

    def deliver(self, event: scheduler_pb2.RequestEvent) -> None:
        """Merge an output into its sample's pending one (repeated fields append, a set field overrides), or
        note the error that ends the request."""
        if self.error is not None:
            return
        if event.HasField("error"):
            self.fail(UpstreamError(STATUS_CODES.get(event.error.code, grpc.StatusCode.UNKNOWN),
                                    event.error.message))
            return
        output = event.output
        if output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished.add(output.index)
        merged = self.pending.get(output.index)
        if merged is None:
            self.pending[output.index] = output
        else:
            merged.MergeFrom(output)
        self.wake()

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
            self.wake()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def __aiter__(self) -> UpstreamRequest:
        return self

    async def __anext__(self) -> scheduler_pb2.ScheduleResponse:
        """The next sample's merged output once it holds min_tokens or finished; after the outputs that arrived
        before it, the request's error."""
        while not self.ready:
            self.ready = self.take_ready()
            if self.ready:
                break
            if self.error is not None:
                raise self.error
            if len(self.finished) == self.num_samples:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.ready.pop()

    def take_ready(self) -> list[scheduler_pb2.ScheduleResponse]:
        """The pending outputs to hand out now, last first: those holding min_tokens or finished, all once the
        request failed."""
        if not self.pending:
            return []
        indices = [index for index, output in self.pending.items() if self.error is not None or
                   len(output.token_ids) >= self.min_tokens or
                   output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
        return [self.pending.pop(index) for index in reversed(indices)]

    def close(self) -> None:
        self.connection.release(self)


class SchedulerConnection:
    """The router's Connect stream to one scheduler, opened on the first submit."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()):
        self.stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self.metadata = metadata   # the cluster token
        self.outgoing: asyncio.Queue | None = None   # None: no stream open
        self.requests: dict[str, UpstreamRequest] = {}
        self.reader: asyncio.Task | None = None

    def submit(self, request: scheduler_pb2.ScheduleRequest, trace_context: dict[str, str]) -> UpstreamRequest:
        upstream = UpstreamRequest(self, request.request_id, request.sampling.n or 1)
        if request.request_id in self.requests:   # its events could not be told apart
            upstream.fail(UpstreamError(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"request_id {request.request_id!r} is already in use"))
            return upstream
        if self.outgoing is None:
            self.open()
        self.requests[request.request_id] = upstream
        submit = scheduler_pb2.SubmitRequest(request=request, trace_context=trace_context)
        self.outgoing.put_nowait(scheduler_pb2.ConnectRequest(submit=submit))
        return upstream

    def release(self, upstream: UpstreamRequest) -> None:
        if self.requests.get(upstream.request_id) is not upstream:
            return
        del self.requests[upstream.request_id]
        if not upstream.ended:   # client gone, stop string matched: the scheduler frees its blocks
            abort = scheduler_pb2.AbortRequest(request_id=upstream.request_id)
            self.outgoing.put_nowait(scheduler_pb2.ConnectRequest(abort=abort))

    def open(self) -> None:
        self.outgoing = asyncio.Queue()
        call = self.stub.Connect(outgoing_messages(self.outgoing), metadata=self.metadata)
        self.reader = asyncio.create_task(self.read(call))

    async def read(self, call: grpc.aio.StreamStreamCall) -> None:
        reason = "the scheduler closed the stream"
        try:
            async for message in call:
                for event in message.events:
                    upstream = self.requests.get(event.request_id)
                    if upstream is not None:
                        upstream.deliver(event)
        except grpc.aio.AioRpcError as e:
            reason = f"lost the stream to the scheduler: {e.code().name}: {e.details()}"
        finally:
            self.disconnect(reason)

    def disconnect(self, reason: str) -> None:
        """Fail every request on the stream; the next submit opens a new one."""
        self.outgoing.put_nowait(CLOSE)
        self.outgoing = None
        failed, self.requests = self.requests, {}
        for upstream in failed.values():
            upstream.fail(UpstreamError(grpc.StatusCode.UNAVAILABLE, reason, connection_lost=True))


async def outgoing_messages(queue: asyncio.Queue) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
    while (message := await queue.get()) is not CLOSE:
        yield message
