"""Disaggregated prefill and decode through `ferry up --prefill-schedulers 1 --decode-schedulers 1`: every request's
prompt is computed on the prefill scheduler and its KV pulled by the decode scheduler, which generates; the output
is token-exact against transformers (greedy, fp32) under preemption, and seeded samples (n = 2) are those of one
scheduler computing everything (the in-process Engine)."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from base.cluster_auth import token_metadata
from ferry import Engine, EngineConfig, SamplingParams
from protos import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import transformers_greedy
from tests.engine_fixtures import hf_model, random_prompts
from tests.services_fixtures import child_pids, ferry_up, greedy

__all__ = ["hf_model"]   # the shared fixture

CLUSTER_TOKEN = "pd-test-cluster-token"
POOL_BYTES = 40 * 8192      # 40 blocks of the tiny Llama: six long requests at once preempt


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with ferry_up(["--http-port", "0", "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
                   "--prefill-schedulers", "1", "--decode-schedulers", "1", "--kv-cache-memory", str(POOL_BYTES),
                   "--heartbeat-ttl", "2", "--cluster-token", CLUSTER_TOKEN]) as (channel, pid):
        yield router_pb2_grpc.RouterStub(channel), pid


def scheduler_stats(up_pid: int) -> dict[str, scheduler_pb2.StatsResponse]:
    """Each scheduler's stats by its role."""
    found = {}
    for pid in child_pids(up_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "scheduler" in argv and "--role" in argv:
            with grpc.insecure_channel(f"127.0.0.1:{argv[argv.index('--port') + 1]}") as channel:
                found[argv[argv.index("--role") + 1]] = scheduler_pb2_grpc.SchedulerStub(channel).Stats(
                    scheduler_pb2.StatsRequest(), metadata=token_metadata(CLUSTER_TOKEN))
    return found


def generate(router, prompt: list[int], sampling: common_pb2.SamplingParams) -> list[list[int]]:
    """Each sample's tokens."""
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling)
    samples: dict[int, list[int]] = {}
    for response in router.Generate(request, timeout=300):
        samples.setdefault(response.index, []).extend(response.token_ids)
    return [samples[i] for i in sorted(samples)]


def test_prompts_prefilled_on_one_scheduler_decode_on_the_other_as_transformers(stack, hf_model):
    router, up_pid = stack
    prompts = random_prompts(seed=31, count=6, lengths=range(80, 110))
    expected = transformers_greedy(hf_model, prompts, 40)
    before = scheduler_stats(up_pid)
    assert set(before) == {"prefill", "decode"}
    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(lambda p: generate(router, p, greedy(40, ignore_eos=True))[0], prompts))
    assert outputs == expected
    after = scheduler_stats(up_pid)
    assert after["prefill"].prompt_tokens_total - before["prefill"].prompt_tokens_total >= sum(map(len, prompts))
    assert after["prefill"].generation_tokens_total - before["prefill"].generation_tokens_total == len(prompts)
    assert after["decode"].kv_pulls - before["decode"].kv_pulls == len(prompts)
    assert after["decode"].kv_pulled_blocks - before["decode"].kv_pulled_blocks > 0
    # the decode side's pool ran dry: a running sequence was preempted, or, as the requests' timing falls, a pull
    # found no free block for its KV and its prompt was recomputed (scheduler/kv_transfer.py); the tokens are exact
    preempted = after["decode"].num_preemptions - before["decode"].num_preemptions
    pulls_short = after["decode"].kv_pull_failures - before["decode"].kv_pull_failures
    assert preempted + pulls_short > 0 and pulls_short < len(prompts)


def test_seeded_samples_after_the_hand_off_are_those_of_one_scheduler(stack, tiny_llama_dir):
    router, _ = stack
    prompt = random_prompts(seed=32, count=1, lengths=range(70, 71))[0]
    sampling = common_pb2.SamplingParams(max_tokens=16, temperature=0.9, seed=5, n=2, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22))
    alone = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.9, seed=5, n=2,
                                                     ignore_eos=True))[0]
    assert generate(router, prompt, sampling) == [s.token_ids for s in alone.samples]


def test_requests_sent_while_the_prefill_scheduler_is_dead_are_served_by_the_decode_one(stack, hf_model):
    router, up_pid = stack
    prefill_pid = next(pid for pid in child_pids(up_pid)
                       if b"--role\0prefill" in Path(f"/proc/{pid}/cmdline").read_bytes())
    prompts = random_prompts(seed=33, count=3, lengths=range(40, 60))
    expected = transformers_greedy(hf_model, prompts, 12)
    os.kill(prefill_pid, signal.SIGKILL)
    assert [generate(router, p, greedy(12, ignore_eos=True))[0] for p in prompts] == expected
