"""A scheduler's Connect stream on real processes: one message carries a step's tokens of many requests; closing
the stream or aborting on it frees the blocks; bad or duplicate requests are refused while the stream serves on."""
from __future__ import annotations

import grpc
import pytest

from protos import scheduler_pb2, scheduler_pb2_grpc
from tests.services_fixtures import ConnectStream, greedy, served_alone, start_services, wait_until

CONNECT_PROMPTS = [[5 + i, 17, 33, 9 + i, 120 + 7 * i] for i in range(6)]   # shorter than a block: no cache hits


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir)
    yield stack
    stack.stop()


def first_scheduler(services) -> tuple[str, scheduler_pb2_grpc.SchedulerStub]:
    address = services.scheduler_addresses[0]
    return address, scheduler_pb2_grpc.SchedulerStub(services.channel(address))


def pool_state(stats: scheduler_pb2.StatsResponse) -> tuple[int, int, int]:
    return stats.num_running, stats.num_waiting, stats.num_free_blocks


def test_connect_sends_a_steps_tokens_of_many_requests_in_one_message_and_each_as_if_alone(services):
    _, stub = first_scheduler(services)
    stream = ConnectStream(stub)
    ids = [f"batched-{i}" for i in range(len(CONNECT_PROMPTS))]
    for request_id, prompt in zip(ids, CONNECT_PROMPTS):
        stream.submit(request_id, prompt, greedy(16, ignore_eos=True))
    stream.read_until(lambda: all(stream.done(i) for i in ids))
    stream.done_sending()
    stream.read_to_the_end()           # nothing is live on it any more: the scheduler ends the stream
    assert not stream.errors
    assert max(len({event.request_id for event in m.events}) for m in stream.messages) > 1
    for request_id, prompt in zip(ids, CONNECT_PROMPTS):
        alone = served_alone(stub, prompt, greedy(16, ignore_eos=True))
        assert stream.outputs[request_id] == alone.outputs["alone"]
        assert stream.outputs[request_id][0].num_prompt_tokens == len(prompt)


def test_closing_a_connect_stream_aborts_its_requests_and_frees_their_blocks(services):
    wait_until(services.idle, "pools idle before the test")
    address, stub = first_scheduler(services)
    before = services.scheduler_stats(address)
    stream = ConnectStream(stub)
    ids = [f"closed-{i}" for i in range(3)]
    for i, request_id in enumerate(ids):
        stream.submit(request_id, [5, 6, 7 + i], greedy(600, ignore_eos=True))
    stream.read_until(lambda: all(stream.outputs[i] for i in ids))
    assert services.scheduler_stats(address).num_running == 3
    stream.cancel()
    wait_until(lambda: pool_state(services.scheduler_stats(address)) == pool_state(before),
               "the pool back to its starting state", timeout=10)
    generated = services.scheduler_stats(address).generation_tokens_total - before.generation_tokens_total
    assert generated < 600, "the requests ran on after their stream was closed"


def test_abort_on_a_connect_stream_frees_that_request_while_another_completes(services):
    wait_until(services.idle, "pools idle before the test")
    address, stub = first_scheduler(services)
    before = services.scheduler_stats(address)
    stream = ConnectStream(stub)
    stream.submit("aborted", [5, 6, 7], greedy(600, ignore_eos=True))
    stream.submit("completes", CONNECT_PROMPTS[0], greedy(400, ignore_eos=True))
    stream.read_until(lambda: stream.outputs["aborted"] and stream.outputs["completes"])
    stream.abort("aborted")
    wait_until(lambda: services.scheduler_stats(address).num_running == 1, "only the other request running")
    stream.read_until(lambda: stream.done("completes"))
    stream.done_sending()
    stream.read_to_the_end()
    assert len(stream.tokens("completes")) == 400 and not stream.errors
    assert len(stream.tokens("aborted")) < 600 and not stream.finished["aborted"]
    wait_until(lambda: pool_state(services.scheduler_stats(address)) == pool_state(before),
               "every block free again", timeout=10)
    generated = services.scheduler_stats(address).generation_tokens_total - before.generation_tokens_total
    assert generated < 400 + 600, "the aborted request ran to its end"
    alone = served_alone(stub, CONNECT_PROMPTS[0], greedy(400, ignore_eos=True))
    assert stream.tokens("completes") == alone.tokens("alone")


@pytest.mark.parametrize("request_id, prompt, sampling, reason", [
    ("empty", [], greedy(4), "prompt must not be empty"),
    ("bad-top-p", [5, 6], greedy(4, top_p=1.5), "top_p"),
    ("bad-token", [5, 100000], greedy(4), "token ids"),
    ("", [5, 6], greedy(4), "needs a request_id"),
])
def test_bad_request_on_a_connect_stream_gets_invalid_argument_and_the_stream_serves_on(services, request_id,
                                                                                         prompt, sampling, reason):
    _, stub = first_scheduler(services)
    stream = ConnectStream(stub)
    stream.submit(request_id, prompt, sampling)
    stream.submit("after-the-bad-one", [5, 6, 7], greedy(4, ignore_eos=True))
    stream.read_until(lambda: stream.done(request_id) and stream.done("after-the-bad-one"))
    stream.done_sending()
    stream.read_to_the_end()
    error = stream.errors[request_id]
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and reason in error.message
    assert len(stream.tokens("after-the-bad-one")) == 4 and "after-the-bad-one" not in stream.errors


def test_a_request_id_live_on_a_connect_stream_cannot_be_submitted_again(services):
    _, stub = first_scheduler(services)
    stream = ConnectStream(stub)
    stream.submit("twice", [5, 6, 7], greedy(200, ignore_eos=True))
    stream.submit("twice", [5, 6, 8], greedy(4))
    stream.read_until(lambda: "twice" in stream.errors)
    error = stream.errors["twice"]
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already in use" in error.message
    stream.read_until(lambda: stream.finished["twice"])
    assert len(stream.tokens("twice")) == 200
    stream.cancel()


def test_outputs_piled_up_past_the_split_size_go_out_in_several_messages_in_order():
    """A step's outputs are merged into one message only up to a size both ends accept: the prompt logprobs of
    long prompts, or a slow reader's backlog, go out in several messages rather than one too big to receive."""
    import asyncio
    from types import SimpleNamespace

    from protos import common_pb2
    from scheduler.core import RequestOutput
    from scheduler.engine_loop import RequestStream
    from scheduler.grpc_service import Connection

    async def messages() -> list[scheduler_pb2.ConnectResponse]:
        connection = Connection(SimpleNamespace(streams={}), split_bytes=4096)
        logprobs = [common_pb2.TokenLogprob(token_id=t, logprob=-1.5) for t in range(200)]   # ~2 KB an output
        for i in range(8):
            stream = RequestStream(f"r{i}", 1, connection.outputs)
            connection.live[stream.request_id] = stream
            stream.put(RequestOutput(stream.request_id, 0, [i], prompt_logprobs=logprobs, finish_reason="length"))
        sent = []
        while not connection.outputs.empty():
            sent.append(await connection.next_message())
        return sent

    sent = asyncio.run(messages())
    assert len(sent) > 1 and all(m.ByteSize() < 2 * 4096 for m in sent)
    assert [e.request_id for m in sent for e in m.events] == [f"r{i}" for i in range(8)]
