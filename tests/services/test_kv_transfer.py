"""KV pulled between two real schedulers (scheduler/kv_transfer.py): a prompt whose prefix one scheduler computed
is served by the other from the pulled blocks, token-exact against transformers (greedy, fp32), with seeded n = 2
and under preemption; a layout that differs is refused naming the field; a peer that stalls or is killed
mid-pull leaves the request to recompute its prefix, and it still finishes token-exact."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from base.cluster_auth import token_metadata
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from protos.block_hash import hash_blocks, root_hash
from scheduler.kv_transfer import PULL_STALL_S
from tests.conftest import transformers_greedy
from tests.engine_fixtures import hf_model, random_prompts
from tests.services_fixtures import ConnectStream, greedy, start_services, wait_until

__all__ = ["hf_model"]   # the shared fixture

BLOCK = 16
MAX_TOKENS = 12
POOL_BLOCKS = 40    # the tiny Llama's blocks are 8 KiB: six long requests at once preempt


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    services = start_services(tiny_llama_dir, num_schedulers=2, **{"--kv-cache-memory": str(POOL_BLOCKS * 8192)})
    yield services
    services.stop()


def stub(stack, index: int) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(stack.channel(stack.scheduler_addresses[index]))


def source(stack, index: int, num_blocks: int) -> scheduler_pb2.KvSource:
    return scheduler_pb2.KvSource(scheduler_id=f"sched-{index}", address=stack.scheduler_addresses[index],
                                  num_blocks=num_blocks)


def serve(stack, index: int, prompts: list[list[int]], sampling: common_pb2.SamplingParams,
          kv_source: scheduler_pb2.KvSource | None = None, samples: int = 1) -> ConnectStream:
    """The prompts on one scheduler at once, read until all are done."""
    stream = ConnectStream(stub(stack, index), timeout=120)
    for i, prompt in enumerate(prompts):
        stream.submit(f"r{i}", prompt, sampling, kv_source=kv_source)
    stream.read_until(lambda: all(stream.done(f"r{i}", samples) for i in range(len(prompts))))
    stream.cancel()
    return stream


def stats(stack, index: int) -> scheduler_pb2.StatsResponse:
    return stack.scheduler_stats(stack.scheduler_addresses[index])


def first_output(stream: ConnectStream, request_id: str = "r0") -> scheduler_pb2.ScheduleResponse:
    return stream.outputs[request_id][0]


def test_a_pulled_prefix_is_served_token_exact_from_the_peers_blocks(stack, hf_model):
    prompt = random_prompts(seed=21, count=1, lengths=range(100, 101))[0]    # 6 full blocks before its last token
    expected = transformers_greedy(hf_model, [prompt], MAX_TOKENS)[0]
    assert serve(stack, 0, [prompt], greedy(MAX_TOKENS, ignore_eos=True)).tokens("r0") == expected
    before, served_before = stats(stack, 1), stats(stack, 0).kv_served_blocks
    pulled = serve(stack, 1, [prompt], greedy(MAX_TOKENS, ignore_eos=True), source(stack, 0, 6))
    assert pulled.tokens("r0") == expected
    assert first_output(pulled).num_cached_tokens == 6 * BLOCK   # the pulled blocks were cache hits
    after = stats(stack, 1)
    assert (after.kv_pulls - before.kv_pulls, after.kv_pulled_blocks - before.kv_pulled_blocks) == (1, 6)
    assert after.kv_pulled_bytes - before.kv_pulled_bytes == 6 * 8192
    assert stats(stack, 0).kv_served_blocks - served_before == 6
    assert after.kv_pull_failures == before.kv_pull_failures


def test_two_seeded_samples_after_a_pull_are_those_of_the_holder(stack):
    prompt = random_prompts(seed=22, count=1, lengths=range(70, 71))[0]
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=5, n=2, ignore_eos=True)
    held = serve(stack, 0, [prompt], sampling, samples=2)
    pulled = serve(stack, 1, [prompt], sampling, source(stack, 0, 4), samples=2)
    by_sample = lambda s: sorted((o.index, tuple(o.token_ids)) for o in s.outputs["r0"])  # noqa: E731
    assert by_sample(pulled) == by_sample(held)
    assert first_output(pulled).num_cached_tokens == 4 * BLOCK


def test_pulled_prefixes_under_preemption_give_the_tokens_of_transformers(stack, hf_model):
    prompts = random_prompts(seed=23, count=6, lengths=range(90, 110))
    expected = transformers_greedy(hf_model, prompts, 40)
    assert serve(stack, 0, prompts[:3], greedy(40, ignore_eos=True)).tokens("r0") == expected[0]
    preempted = stats(stack, 1).num_preemptions
    pulled = serve(stack, 1, prompts, greedy(40, ignore_eos=True), source(stack, 0, 5))
    assert [pulled.tokens(f"r{i}") for i in range(len(prompts))] == expected
    assert stats(stack, 1).num_preemptions > preempted


def test_a_peer_of_another_layout_is_refused_naming_what_differs(stack):
    layout = scheduler_pb2.KvLayout(model_name="tiny", dtype="bfloat16", block_size=BLOCK)
    call = stub(stack, 0).FetchBlocks(scheduler_pb2.FetchBlocksRequest(block_hashes=[1, 2], layout=layout),
                                      metadata=token_metadata(stack.cluster_token), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        list(call)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    assert "KV layouts differ" in details and "dtype: 'bfloat16' here 'float32'" in details


def test_a_peer_on_another_host_gets_the_blocks_in_the_stream(stack, tiny_llama_dir):
    """No shared-memory probe (a caller elsewhere): the KV comes as bytes, whole blocks per message, and only the
    leading run cached here."""
    prompt = random_prompts(seed=26, count=1, lengths=range(50, 51))[0]
    serve(stack, 0, [prompt], greedy(1))
    model_name = Path(tiny_llama_dir).name
    hashes = hash_blocks(prompt, BLOCK, model_name)
    layout = scheduler_pb2.KvLayout(model_name=model_name, dtype="float32", block_size=BLOCK, num_layers=2,
                                    num_kv_heads=2, head_dim=16, tensor_parallel_size=1,
                                    hash_root=root_hash(model_name), block_bytes=8192)
    request = scheduler_pb2.FetchBlocksRequest(block_hashes=hashes + [12345], layout=layout)
    chunks = list(stub(stack, 0).FetchBlocks(request, metadata=token_metadata(stack.cluster_token), timeout=10))
    assert [h for c in chunks for h in c.block_hashes] == hashes             # 3 full blocks; the made-up one not
    assert sum(len(c.data) for c in chunks) == len(hashes) * 8192 and not any(c.shm_path for c in chunks)


def test_a_stalled_peer_leaves_the_prefix_to_recompute(stack, hf_model):
    prompt = random_prompts(seed=24, count=1, lengths=range(80, 81))[0]
    expected = transformers_greedy(hf_model, [prompt], MAX_TOKENS)[0]
    serve(stack, 0, [prompt], greedy(MAX_TOKENS, ignore_eos=True))
    failures = stats(stack, 1).kv_pull_failures
    holder = stack.schedulers[0].pid
    os.kill(holder, signal.SIGSTOP)
    try:
        pulled = serve(stack, 1, [prompt], greedy(MAX_TOKENS, ignore_eos=True), source(stack, 0, 4))
    finally:
        os.kill(holder, signal.SIGCONT)
    assert pulled.tokens("r0") == expected
    assert stats(stack, 1).kv_pull_failures == failures + 1


def test_a_peer_killed_mid_pull_fails_no_request(stack, hf_model):
    """The holder is stopped once the pull has begun (the request held, waiting for blocks), then killed: the
    request is released at once to recompute, well before the stall timeout."""
    prompts = random_prompts(seed=25, count=3, lengths=range(60, 90))
    expected = transformers_greedy(hf_model, prompts, MAX_TOKENS)
    serve(stack, 0, prompts, greedy(MAX_TOKENS, ignore_eos=True))
    holder = stack.schedulers[0]
    os.kill(holder.pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        pulling = pool.submit(serve, stack, 1, prompts, greedy(MAX_TOKENS, ignore_eos=True), source(stack, 0, 3))
        wait_until(lambda: stats(stack, 1).num_held_requests == len(prompts), "the pulls begun", timeout=PULL_STALL_S)
        holder.kill()
        holder.wait()
        pulled = pulling.result(timeout=60)
    assert [pulled.tokens(f"r{i}") for i in range(len(prompts))] == expected
