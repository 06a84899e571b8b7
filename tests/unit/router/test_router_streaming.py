"""How the router paces a stream (issue 21): a client slower than the scheduler gets its pending tokens in one
message, and a client's stream_interval sets the tokens per message; either way every token arrives, in order."""
from __future__ import annotations

import asyncio

from benchmarks.services.synthetic_scheduler import single_character_tokens
from protos import common_pb2, router_pb2
from router.core import Router
from tests.synthetic_fixtures import synthetic_scheduler

NUM_TOKENS = 40


async def stream(tokenizer_dir: str, stream_interval: int = 0, read_delay: float = 0.0,
                 step_interval: float = 0.002, router_stream_interval: int = 1
                 ) -> tuple[list[int], list[router_pb2.GenerateResponse]]:
    """One request through a Router (started with --stream-interval router_stream_interval) to a synthetic
    scheduler stepping every step_interval; the reader waits read_delay after each message. Returns the tokens the
    scheduler emits for it and the messages the reader got."""
    token_ids = single_character_tokens(tokenizer_dir)
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]),
                                         sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS),
                                         stream_interval=stream_interval)
    messages = []
    async with synthetic_scheduler(tokenizer_dir, step_interval) as (directory, _):
        async for response in Router(directory, stream_interval=router_stream_interval).generate(request):
            messages.append(response)
            await asyncio.sleep(read_delay)
    return [token_ids[i % len(token_ids)] for i in range(NUM_TOKENS)], messages


def streamed_tokens(messages: list[router_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def test_a_slow_client_gets_every_token_in_order_in_fewer_messages(tokenizer_dir):
    expected, messages = asyncio.run(stream(tokenizer_dir, read_delay=0.02))   # 10 steps per read
    assert streamed_tokens(messages) == expected
    assert "".join(m.text for m in messages) == "abcdefghijklmnopqrstuvwxyzabcdefghijklmn"
    assert len(messages) < NUM_TOKENS / 3
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == NUM_TOKENS


def test_a_client_keeping_up_gets_a_message_per_step(tokenizer_dir):
    expected, messages = asyncio.run(stream(tokenizer_dir, step_interval=0.01))
    assert streamed_tokens(messages) == expected
    assert len(messages) > NUM_TOKENS / 2


def test_stream_interval_holds_tokens_until_that_many_arrived(tokenizer_dir):
    expected, messages = asyncio.run(stream(tokenizer_dir, stream_interval=7))
    assert streamed_tokens(messages) == expected
    assert all(len(m.token_ids) >= 7 for m in messages[:-1])
    assert len(messages) <= NUM_TOKENS // 7 + 1


def test_the_routers_stream_interval_holds_the_tokens_of_requests_that_set_none(tokenizer_dir):
    expected, messages = asyncio.run(stream(tokenizer_dir, step_interval=0.01, router_stream_interval=5))
    assert streamed_tokens(messages) == expected
    assert [len(m.token_ids) for m in messages] == [5] * (NUM_TOKENS // 5)


def test_a_request_asking_for_every_token_gets_them_one_by_one_whatever_the_routers_stream_interval(tokenizer_dir):
    expected, messages = asyncio.run(stream(tokenizer_dir, stream_interval=1, step_interval=0.01,
                                            router_stream_interval=5))
    assert streamed_tokens(messages) == expected
    assert len(messages) > NUM_TOKENS / 2


def test_a_stop_string_inside_merged_tokens_ends_the_sample_at_the_token_that_completed_it():
    from protos import scheduler_pb2
    from router.core import SampleState, StreamState
    from router.detokenizer import IncrementalDetokenizer

    def letters(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    state = StreamState("r", 3, [SampleState(IncrementalDetokenizer(letters, ("cd",)))])
    merged = scheduler_pb2.ScheduleResponse(token_ids=[0, 1, 2, 3, 4, 5],   # "abcdef": "cd" ends at token 3
                                            logprobs=[common_pb2.TokenLogprob(token_id=i) for i in range(6)])
    response = state.on_response(merged)
    assert response.text == "ab" and response.stop_reason == "cd"
    assert list(response.token_ids) == [0, 1, 2, 3] and len(response.logprobs) == 4
    assert response.finish_reason == common_pb2.FINISH_REASON_STOP
    assert response.usage.completion_tokens == 4


def test_continuous_usage_puts_the_requests_usage_so_far_on_every_response():
    from protos import scheduler_pb2
    from router.core import SampleState, StreamState
    from router.detokenizer import IncrementalDetokenizer

    def letters(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    def state(continuous: bool) -> StreamState:
        return StreamState("r", 5, [SampleState(IncrementalDetokenizer(letters, ())) for _ in range(2)],
                           continuous_usage=continuous)

    steps = [scheduler_pb2.ScheduleResponse(index=0, token_ids=[1, 2]),
             scheduler_pb2.ScheduleResponse(index=1, token_ids=[3]),
             scheduler_pb2.ScheduleResponse(index=0, token_ids=[4], finish_reason=common_pb2.FINISH_REASON_LENGTH),
             scheduler_pb2.ScheduleResponse(index=1, token_ids=[5], finish_reason=common_pb2.FINISH_REASON_LENGTH)]
    continuous, last_only = state(True), state(False)
    assert [continuous.on_response(s).usage.completion_tokens for s in steps] == [2, 3, 4, 5]
    assert all(r.usage.prompt_tokens == 5 for r in map(state(True).on_response, steps))
    assert [last_only.on_response(s).HasField("usage") for s in steps] == [False, False, False, True]
