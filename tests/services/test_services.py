"""The services as real processes: redis-server, 2 schedulers with their workers, a router, over real gRPC."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import common_pb2, router_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.services_fixtures import (HEARTBEAT_TTL_S, ConnectStream, cancel_beside_others, child_pids, collect, greedy,
                                     indexed_blocks, matching_engine, registered_schedulers, served_alone,
                                     start_services, wait_until)

PROMPTS = [f"Paris is the capital of France {i}. The quick brown fox" for i in range(32)]


@pytest.fixture(scope="module")
def services(tiny_llama_dir):
    stack = start_services(tiny_llama_dir)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return matching_engine(tiny_llama_dir)


def engine_greedy(engine, prompts, max_tokens, **params):
    from base.sampling_params import SamplingParams

    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def test_streamed_greedy_completion_matches_engine(services, engine):
    expected = engine_greedy(engine, [PROMPTS[0]], 24)[0]
    token_ids, text, messages = collect(services.router().Generate(
        router_pb2.GenerateRequest(text=PROMPTS[0], sampling=greedy(24))))
    assert token_ids == expected.token_ids
    assert text == expected.text
    assert len(messages) == len(token_ids)          # one message per token: streamed, not batched at the end
    assert messages[-1].finish_reason == expected_finish(expected.finish_reason)
    assert messages[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert messages[-1].usage.completion_tokens == len(token_ids)


def expected_finish(reason: str) -> int:
    return {"length": 1, "stop": 2}[reason]


def test_chat_prompt_uses_the_chat_template(services, engine):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = list(engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
    expected = engine_greedy(engine, [prompt_ids], 12)[0]
    request = router_pb2.GenerateRequest(sampling=greedy(12))
    request.chat.messages.add(role="user", content=chat[0]["content"])
    token_ids, text, messages = collect(services.router().Generate(request))
    assert token_ids == expected.token_ids and text == expected.text
    assert messages[-1].usage.prompt_tokens == len(prompt_ids)


def test_32_concurrent_streams_all_complete_correctly(services, engine):
    expected = engine_greedy(engine, PROMPTS, 16)

    def run(prompt):
        return collect(services.router().Generate(router_pb2.GenerateRequest(text=prompt, sampling=greedy(16))))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, PROMPTS))
    for (token_ids, text, _), want in zip(results, expected):
        assert token_ids == want.token_ids
        assert text == want.text
    used = [services.scheduler_stats(a).generation_tokens_total for a in services.scheduler_addresses]
    assert all(n > 0 for n in used), f"both schedulers should have served some streams, got {used}"


def test_first_token_arrives_before_the_last_is_computed(services):
    stream = services.router().Generate(router_pb2.GenerateRequest(
        text=PROMPTS[1], sampling=greedy(400, ignore_eos=True)))
    first = next(stream)
    assert len(first.token_ids) == 1
    running = sum(services.scheduler_stats(a).num_running for a in services.scheduler_addresses)
    assert running == 1, "the request should still be generating when its first token arrives"
    rest = list(stream)
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 400


def test_cancelled_stream_frees_its_blocks_and_others_are_unaffected(services, engine):
    wait_until(services.idle, "pools idle before the test")
    cancel_beside_others(services, PROMPTS[6], PROMPTS[2:6], greedy(32), engine_greedy(engine, PROMPTS[2:6], 32))


def test_a_second_router_serves_the_same_schedulers(services, engine):
    import sys

    from ferry.launcher import free_port, wait_for_health
    from protos import router_pb2_grpc
    from tests.services_fixtures import CHILD_ENV

    port = free_port()
    services.stack.start([sys.executable, "-m", "router", "--port", str(port), "--redis-url", services.redis_url,
                          "--http-port", "0"],
                         "second router", env=CHILD_ENV)
    wait_for_health(f"127.0.0.1:{port}", services.stack, timeout=60)
    expected = engine_greedy(engine, [PROMPTS[3]], 8)[0]
    second = router_pb2_grpc.RouterStub(services.channel(f"127.0.0.1:{port}"))
    token_ids, text, _ = collect(second.Generate(router_pb2.GenerateRequest(text=PROMPTS[3], sampling=greedy(8))))
    assert token_ids == expected.token_ids and text == expected.text


def test_stop_string_ends_the_stream_and_is_never_streamed(services, engine):
    full = engine_greedy(engine, [PROMPTS[7]], 32)[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop and stop in full
    token_ids, text, messages = collect(services.router().Generate(router_pb2.GenerateRequest(
        text=PROMPTS[7], sampling=greedy(32, stop=[stop]))))
    assert text == full[:full.index(stop)]
    assert messages[-1].finish_reason == 2 and messages[-1].stop_reason == stop
    assert messages[-1].HasField("usage")
    wait_until(services.idle, "the stopped request aborted upstream", timeout=10)


@pytest.mark.parametrize("request_fields, reason", [
    (dict(text=""), "prompt must not be empty"),
    (dict(text="hello", sampling=greedy(8, top_p=1.5)), "top_p"),
    (dict(text="hello", sampling=greedy(8, top_k=-5)), "top_k"),
    (dict(text="hello", sampling=greedy(0)), "max_tokens"),
    (dict(text="hello " * 1200, sampling=greedy(8)), "max_model_len"),
    (dict(token_ids=router_pb2.TokenIds(ids=[1, 2, 100000]), sampling=greedy(8)), "token ids"),
])
def test_bad_input_is_invalid_argument_and_services_keep_serving(services, request_fields, reason):
    with pytest.raises(grpc.RpcError) as error:
        collect(services.router().Generate(router_pb2.GenerateRequest(**request_fields)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in error.value.details()
    token_ids, _, _ = collect(services.router().Generate(router_pb2.GenerateRequest(text="hi", sampling=greedy(4))))
    assert len(token_ids) >= 1


def test_a_model_no_scheduler_serves_is_not_found_naming_it_and_what_is_served(services):
    with pytest.raises(grpc.RpcError) as error:
        collect(services.router().Generate(router_pb2.GenerateRequest(text="hello", model="no-such-model")))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'no-such-model' does not exist (serving: " in error.value.details()


def worker_pid(scheduler_pid: int) -> int:
    [worker] = child_pids(scheduler_pid)
    return worker


def test_kv_events_reach_the_redis_prefix_index(services):
    collect(services.router().Generate(router_pb2.GenerateRequest(text=PROMPTS[0] * 4, sampling=greedy(2))))
    redis = services.redis()
    wait_until(lambda: indexed_blocks(redis, "sched-0") or indexed_blocks(redis, "sched-1"), "block hashes published")


def test_a_crashed_workers_request_goes_on_with_the_new_worker_token_for_token(services, engine):
    address, scheduler = services.scheduler_addresses[1], services.schedulers[1]
    stub = scheduler_pb2_grpc.SchedulerStub(services.channel(address))
    redis = services.redis()
    served_alone(stub, list(range(5, 69)), greedy(1))
    wait_until(lambda: indexed_blocks(redis, "sched-1"), "sched-1's blocks in the prefix index")
    old_pool = set(indexed_blocks(redis, "sched-1"))
    generated_before = services.scheduler_stats(address).generation_tokens_total
    stream = ConnectStream(stub)
    stream.submit("in-flight", [5, 6, 7], greedy(600, ignore_eos=True))
    stream.read_until(lambda: stream.outputs["in-flight"])
    os.kill(worker_pid(scheduler.pid), signal.SIGKILL)
    stream.read_until(lambda: stream.done("in-flight"))
    assert "in-flight" not in stream.errors          # resumed on the new worker from the tokens it had
    assert stream.tokens("in-flight") == engine_greedy(engine, [[5, 6, 7]], 600, ignore_eos=True)[0].token_ids
    stream.cancel()

    def serves_again() -> bool:
        return len(served_alone(stub, [5, 6, 7], greedy(3)).tokens("alone")) == 3

    wait_until(serves_again, "the scheduler serves again with a new worker", timeout=60)
    assert scheduler.poll() is None
    assert services.scheduler_stats(address).generation_tokens_total > generated_before   # counters carry on
    # the old pool is gone: the prefix index must not send requests for its blocks here any more
    wait_until(lambda: old_pool.isdisjoint(indexed_blocks(redis, "sched-1")),
               "the dead pool's blocks withdrawn from the index")


def test_a_request_of_several_samples_fails_with_its_worker_and_the_stream_serves_again_after_the_restart(services):
    address, scheduler = services.scheduler_addresses[1], services.schedulers[1]
    stream = ConnectStream(scheduler_pb2_grpc.SchedulerStub(services.channel(address)))
    stream.submit("cut-off", [5, 6, 7], greedy(600, ignore_eos=True, n=2))   # n > 1: cannot be resumed
    stream.read_until(lambda: stream.outputs["cut-off"])
    os.kill(worker_pid(scheduler.pid), signal.SIGKILL)
    stream.read_until(lambda: stream.done("cut-off"))
    assert stream.errors["cut-off"].code == grpc.StatusCode.UNAVAILABLE.value[0]
    for attempt in range(600):        # refused (UNAVAILABLE) until the new worker is up
        stream.submit(f"after-{attempt}", [5, 6, 7], greedy(3))
        stream.read_until(lambda: stream.done(f"after-{attempt}"))
        if f"after-{attempt}" not in stream.errors:
            break
        assert stream.errors[f"after-{attempt}"].code == grpc.StatusCode.UNAVAILABLE.value[0]
        time.sleep(0.1)
    assert len(stream.tokens(f"after-{attempt}")) == 3
    stream.cancel()


def test_requests_are_served_while_redis_is_down_and_schedulers_register_again(services, engine):
    expected = engine_greedy(engine, PROMPTS[12:16], 8)

    def serve_without_redis():
        for prompt, want in zip(PROMPTS[12:16], expected):
            token_ids, _, _ = collect(services.router().Generate(
                router_pb2.GenerateRequest(text=prompt, sampling=greedy(8))))
            assert token_ids == want.token_ids

    services.restart_redis(serve_without_redis)
    wait_until(lambda: len(registered_schedulers(services)) == 2, "schedulers registered in the new redis")


def test_after_redis_loses_its_data_schedulers_register_again_and_republish_the_blocks_they_hold(services):
    stub = scheduler_pb2_grpc.SchedulerStub(services.channel(services.scheduler_addresses[1]))
    served_alone(stub, list(range(100, 164)), greedy(1), "held-through-the-flush")
    redis = services.redis()
    wait_until(lambda: len(indexed_blocks(redis, "sched-1")) >= 4, "the prompt's blocks in the prefix index")
    held = set(indexed_blocks(redis, "sched-1"))
    redis.flushall()
    wait_until(lambda: len(registered_schedulers(services)) == 2, "schedulers registered again")
    wait_until(lambda: held <= set(indexed_blocks(redis, "sched-1")), "the blocks sched-1 holds published again")


def test_killed_scheduler_stops_receiving_requests_within_the_ttl(services, engine):
    streaming = services.router().Generate(router_pb2.GenerateRequest(text=PROMPTS[20] * 4,
                                                                      sampling=greedy(600, ignore_eos=True)))
    received = list(next(streaming).token_ids)
    holder = next(i for i, a in enumerate(services.scheduler_addresses) if services.scheduler_stats(a).num_running)
    victim, survivor = services.schedulers[holder], services.scheduler_addresses[1 - holder]
    wait_until(lambda: indexed_blocks(services.redis(), f"sched-{holder}"), "the victim's prompt blocks indexed")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    received += collect(streaming)[0]                 # already streaming: resumed on the survivor, as one stream
    assert received == engine_greedy(engine, [PROMPTS[20] * 4], 600, ignore_eos=True)[0].token_ids
    # Every key a scheduler writes (registration, prefix index) lives at most one TTL past its last heartbeat, so
    # the dead one's expire within the TTL (asked of Redis rather than timed: a loaded machine stretches the wait,
    # not the key's life).
    ttls_ms = [services.redis().pttl(key) for key in scheduler_written_keys(services)]
    assert all(ttl == -2 or 0 < ttl <= HEARTBEAT_TTL_S * 1000 for ttl in ttls_ms), ttls_ms   # -2: gone already
    wait_until(lambda: len(registered_schedulers(services)) == 1, "the dead scheduler's key expired",
               timeout=HEARTBEAT_TTL_S + 5)
    wait_until(lambda: not indexed_blocks(services.redis(), f"sched-{holder}"), "the dead scheduler's blocks expired",
               timeout=HEARTBEAT_TTL_S)
    before = services.scheduler_stats(survivor).prompt_tokens_total
    expected = engine_greedy(engine, PROMPTS[8:12], 8)
    for prompt, want in zip(PROMPTS[8:12], expected):
        token_ids, _, _ = collect(services.router().Generate(router_pb2.GenerateRequest(text=prompt,
                                                                                       sampling=greedy(8))))
        assert token_ids == want.token_ids
    served = services.scheduler_stats(survivor).prompt_tokens_total - before
    assert served == sum(len(w.prompt_token_ids) for w in expected)


def scheduler_written_keys(services) -> list[bytes]:
    """Every key but the registry set, which all schedulers share and routers prune."""
    return [key for key in services.redis().scan_iter(match="ferry:*") if key != b"ferry:schedulers"]


def test_stop_token_id_zero_is_reported_as_the_stop_reason():
    from router.core import SampleState, StreamState
    from router.detokenizer import IncrementalDetokenizer

    state = StreamState("r", 3, [SampleState(IncrementalDetokenizer(lambda ids: "", (), False))])
    response = state.on_response(scheduler_pb2.ScheduleResponse(token_ids=[0], stop_token_id=0,
                                                                finish_reason=common_pb2.FINISH_REASON_STOP))
    assert response.stop_reason == "0"
