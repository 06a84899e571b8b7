"""Tensor parallelism through `ferry up` (one scheduler driving 2 ranks on gloo): concurrent requests token-exact
against transformers with preemptions and prefix-cache hits; a killed rank takes its group down, the scheduler
starts a new group and the request in flight goes on token for token."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from base.cluster_auth import token_metadata
from protos import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import transformers_greedy
from tests.engine_fixtures import hf_model, random_prompts
from tests.services_fixtures import child_pids, collect, ferry_up, greedy, wait_until

__all__ = ["hf_model"]   # the shared fixture

CLUSTER_TOKEN = "tp-test-cluster-token"
MAX_TOKENS = 24
RANK_BLOCK_BYTES = 2 * 2 * 1 * 16 * 16 * 4   # tiny Llama: 2 layers, K and V, 1 of 2 KV heads, 16 tokens, 16 dims


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with ferry_up(["--http-port", "0", "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
                   "--num-schedulers", "1", "--tensor-parallel-size", "2", "--kv-cache-memory",
                   str(12 * RANK_BLOCK_BYTES), "--cluster-token", CLUSTER_TOKEN], threads=2) as (channel, pid):
        yield router_pb2_grpc.RouterStub(channel), pid


def generate(router, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                         sampling=greedy(max_tokens, ignore_eos=True))
    return collect(router.Generate(request, timeout=300))[0]


def scheduler_stats(up_pid: int) -> scheduler_pb2.StatsResponse:
    for pid in child_pids(up_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "scheduler" in argv and "--port" in argv:
            with grpc.insecure_channel(f"127.0.0.1:{argv[argv.index('--port') + 1]}") as channel:
                return scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(),
                                                                       metadata=token_metadata(CLUSTER_TOKEN))
    raise AssertionError("no scheduler under ferry up")


def ranks(up_pid: int) -> tuple[list[int], list[int]]:
    """The workers (rank 0) under the schedulers, and their followers (ranks 1..: started from a worker's compute
    thread, so not in its main thread's children)."""
    workers = [pid for scheduler in child_pids(up_pid) for pid in child_pids(scheduler)
               if b"gpu_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return workers, [pid for pid, parent in processes() if parent in workers
                     and b"gpu_worker.parallel.follower" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def processes() -> list[tuple[int, int]]:
    """(pid, parent pid) of every live process."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(stat.parent.name), int(fields[1])))
    return found


def test_concurrent_requests_match_transformers_through_preemptions_and_cache_hits(stack, hf_model):
    router, up_pid = stack
    prompts = random_prompts(seed=5, count=8, lengths=range(20, 48))
    expected = transformers_greedy(hf_model, prompts, MAX_TOKENS)
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(lambda p: generate(router, p), prompts)) == expected
    assert scheduler_stats(up_pid).num_preemptions > 0
    assert generate(router, prompts[0]) == expected[0]   # cached now, whatever the batch above evicted
    hits = scheduler_stats(up_pid).prefix_cache_hits
    assert generate(router, prompts[0]) == expected[0]
    assert scheduler_stats(up_pid).prefix_cache_hits > hits


def test_a_killed_rank_ends_its_group_and_the_request_goes_on_in_a_new_one(stack, hf_model):
    router, up_pid = stack
    prompt, long = random_prompts(seed=9, count=1, lengths=range(12, 13))[0], 160
    expected = transformers_greedy(hf_model, [prompt], long)[0]
    workers, followers = ranks(up_pid)
    assert len(workers) == 1 and len(followers) == 1
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                         sampling=greedy(long, ignore_eos=True))
    responses = router.Generate(request, timeout=300)
    first = list(next(responses).token_ids)
    os.kill(followers[0], signal.SIGKILL)
    assert first + collect(responses)[0] == expected
    wait_until(lambda: not set(ranks(up_pid)[0]) & set(workers) and len(ranks(up_pid)[1]) == 1,
               "a new group of two ranks")
