"""The router's Connect stream to a scheduler (router/upstream.py) against an in-process fake scheduler."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from router.upstream import SchedulerConnection, UpstreamError

QUICK, HELD = 1, 100   # max_tokens: the fake answers a QUICK request at once and never answers a HELD one


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records what arrives on Connect streams; hangs up a stream with UNAVAILABLE when told to."""

    def __init__(self):
        self.connects = 0
        self.submitted: list[scheduler_pb2.SubmitRequest] = []
        self.aborted: list[str] = []
        self.hang_up = asyncio.Event()

    async def Connect(self, request_iterator, context):
        self.connects += 1
        serving = asyncio.create_task(self.serve(request_iterator, context))
        hanging_up = asyncio.create_task(self.hang_up.wait())
        await asyncio.wait([serving, hanging_up], return_when=asyncio.FIRST_COMPLETED)
        serving.cancel()
        hanging_up.cancel()
        if self.hang_up.is_set():
            self.hang_up.clear()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the fake scheduler went away")

    async def serve(self, request_iterator, context) -> None:
        async for message in request_iterator:
            if message.HasField("abort"):
                self.aborted.append(message.abort.request_id)
                continue
            self.submitted.append(message.submit)
            request = message.submit.request
            if request.sampling.max_tokens == QUICK:
                output = scheduler_pb2.ScheduleResponse(token_ids=[len(request.prompt_token_ids)],
                                                        finish_reason=common_pb2.FINISH_REASON_LENGTH)
                response = scheduler_pb2.ConnectResponse()
                response.events.add(request_id=request.request_id, output=output)
                await context.write(response)


def schedule_request(request_id: str, max_tokens: int) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=[5, 6, 7],
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, n=1))


async def eventually(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def responses(upstream) -> list[scheduler_pb2.ScheduleResponse]:
    return [response async for response in upstream]


def with_fake_scheduler(scenario) -> None:
    async def run() -> None:
        fake = FakeScheduler()
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            await asyncio.wait_for(scenario(fake, SchedulerConnection(channel)), timeout=20)
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(run())


def test_requests_share_one_stream_and_carry_their_trace_context():
    async def scenario(fake: FakeScheduler, connection: SchedulerConnection) -> None:
        context = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        for i in range(3):
            upstream = connection.submit(schedule_request(f"r{i}", QUICK), context)
            [output] = await responses(upstream)
            assert list(output.token_ids) == [3] and output.finish_reason == common_pb2.FINISH_REASON_LENGTH
            upstream.close()
        assert fake.connects == 1 and not fake.aborted
        assert all(dict(s.trace_context) == context for s in fake.submitted)

    with_fake_scheduler(scenario)


def test_a_broken_stream_fails_its_requests_unavailable_and_the_next_request_opens_a_fresh_one():
    async def scenario(fake: FakeScheduler, connection: SchedulerConnection) -> None:
        held = [connection.submit(schedule_request(f"held-{i}", HELD), {}) for i in range(2)]
        await eventually(lambda: len(fake.submitted) == 2)
        fake.hang_up.set()
        for upstream in held:
            with pytest.raises(UpstreamError) as error:
                await responses(upstream)
            assert error.value.code == grpc.StatusCode.UNAVAILABLE and "went away" in error.value.message
            upstream.close()
        [output] = await responses(connection.submit(schedule_request("after", QUICK), {}))
        assert output.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert fake.connects == 2 and not fake.aborted   # the failed requests were not the router's to abort

    with_fake_scheduler(scenario)


def test_a_request_left_before_its_end_is_aborted_upstream():
    async def scenario(fake: FakeScheduler, connection: SchedulerConnection) -> None:
        connection.submit(schedule_request("left", HELD), {}).close()
        finished = connection.submit(schedule_request("finished", QUICK), {})
        await responses(finished)
        finished.close()
        await eventually(lambda: fake.aborted == ["left"])
        assert not connection.requests

    with_fake_scheduler(scenario)


def test_a_request_id_live_on_the_connection_is_refused_without_reaching_the_scheduler():
    async def scenario(fake: FakeScheduler, connection: SchedulerConnection) -> None:
        first = connection.submit(schedule_request("same", HELD), {})
        second = connection.submit(schedule_request("same", QUICK), {})
        with pytest.raises(UpstreamError) as error:
            await responses(second)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        second.close()
        assert connection.requests == {"same": first}
        await eventually(lambda: len(fake.submitted) == 1)

    with_fake_scheduler(scenario)


SILENT_SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from base.grpc_options import GRPC_OPTIONS

async def main():
    server = grpc.aio.server(options=GRPC_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_a_scheduler_that_stops_answering_breaks_the_routers_stream_after_its_keepalive():
    """A SIGSTOPped process (a hung host) keeps its TCP connection open: only the pings the router's channels send
    find it out, after keepalive_s of silence and as long again without an answer (gRPC's own wait is 60 s)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from router.discovery import SchedulerDirectory

    server = subprocess.Popen([sys.executable, "-c", SILENT_SERVER], stdout=subprocess.PIPE, text=True)

    async def broken_after() -> tuple[float, grpc.StatusCode]:
        directory = SchedulerDirectory(keepalive_s=1.0)
        call = health_pb2_grpc.HealthStub(directory.channel(f"127.0.0.1:{server.stdout.readline().strip()}")).Watch(
            health_pb2.HealthCheckRequest())
        await call.read()
        os.kill(server.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            await asyncio.wait_for(call.read(), timeout=20)
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            code = e.code()
        await directory.close()
        return time.monotonic() - stopped_at, code

    try:
        seconds, code = asyncio.run(broken_after())
    finally:
        server.kill()
        server.wait()
    assert code == grpc.StatusCode.UNAVAILABLE and seconds < 15, (seconds, code)
