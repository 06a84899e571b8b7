"""A soak: hundreds of valid and invalid requests while a worker is killed and redis restarts; nothing is lost
or leaked."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from base.sampling_params import MAX_SAMPLES, SamplingParams
from protos import common_pb2, router_pb2
from tests.services_fixtures import ServiceStack, child_pids, greedy, start_services, wait_until

SOAK_PROMPTS = [f"Soak prompt {i}: the quick brown fox jumps over the lazy dog" for i in range(8)]
SOAK_MAX_TOKENS = 24
SOAK_REQUESTS = 300
INVALID_SAMPLING = [{"top_p": 0.0}, {"n": MAX_SAMPLES + 1}, {"temperature": -1.0}, {"stop": [""]},
                    {"max_tokens": 5000}, {"logprobs": 99}, {"repetition_penalty": 0.0}]
# what a valid request may end with besides its tokens, and why: a killed worker, a full queue, its own
# deadline, its own cancellation
ALLOWED_FAILURES = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED"}


@dataclass
class SoakCase:
    prompt: int
    sampling: common_pb2.SamplingParams
    valid: bool
    greedy: bool
    timeout: float | None
    cancel_after_first: bool


def soak_case(rng) -> SoakCase:
    max_tokens = rng.randint(1, SOAK_MAX_TOKENS)
    if rng.random() < 0.15:
        prompt = rng.randrange(len(SOAK_PROMPTS))
        invalid = common_pb2.SamplingParams(**{"max_tokens": 4, **rng.choice(INVALID_SAMPLING)})
        return SoakCase(prompt, invalid, False, False, None, False)
    is_greedy = rng.random() < 0.6
    sampling = (greedy(max_tokens, ignore_eos=True) if is_greedy else
                common_pb2.SamplingParams(max_tokens=max_tokens, temperature=rng.uniform(0.5, 1.5),
                                          top_p=rng.uniform(0.5, 1.0), seed=rng.randrange(1000), ignore_eos=True,
                                          n=rng.choice([1, 1, 2])))
    timeout = rng.choice([None] * 6 + [0.05, 1.0])
    return SoakCase(rng.randrange(len(SOAK_PROMPTS)), sampling, True, is_greedy, timeout, rng.random() < 0.1)


def run_soak_case(services: ServiceStack, case: SoakCase) -> tuple[str, list[int], str]:
    call = services.router().Generate(router_pb2.GenerateRequest(text=SOAK_PROMPTS[case.prompt],
                                                                 sampling=case.sampling),
                                      timeout=case.timeout or 60)
    tokens: list[int] = []
    try:
        for message in call:
            tokens += message.token_ids
            if case.cancel_after_first:
                call.cancel()
        return "OK", tokens, ""
    except grpc.RpcError as e:
        return e.code().name, tokens, e.details() or ""


def test_soak_with_a_killed_worker_and_a_redis_restart_loses_and_leaks_nothing(tiny_llama_dir):
    import random

    from base.config import EngineConfig
    from ferry.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    expected = [r.token_ids for r in engine.generate(SOAK_PROMPTS, SamplingParams(
        max_tokens=SOAK_MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    rng = random.Random(1234)
    cases = [soak_case(rng) for _ in range(SOAK_REQUESTS)]
    services = start_services(tiny_llama_dir)
    try:
        workers_before = {p.pid: child_pids(p.pid) for p in services.schedulers}
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(run_soak_case, services, case) for case in cases]
            futures[SOAK_REQUESTS // 3].result()
            os.kill(workers_before[services.schedulers[1].pid][0], signal.SIGKILL)
            futures[2 * SOAK_REQUESTS // 3].result()
            services.restart_redis(lambda: futures[3 * SOAK_REQUESTS // 4].result())
            results = [f.result() for f in futures]
        for case, (status, tokens, details) in zip(cases, results):
            if not case.valid:
                assert status == "INVALID_ARGUMENT" and details, (case, status)
            elif status != "OK":
                assert status in ALLOWED_FAILURES and (details or status == "CANCELLED"), (case, status, details)
            elif case.cancel_after_first:
                assert tokens
            elif case.greedy:
                assert tokens == expected[case.prompt][:case.sampling.max_tokens], case
            else:
                assert len(tokens) == case.sampling.max_tokens * max(1, case.sampling.n), case
        statuses = [status for status, _, _ in results]
        print("soak outcomes:", {s: statuses.count(s) for s in set(statuses)})
        assert statuses.count("OK") > SOAK_REQUESTS // 3, {s: statuses.count(s) for s in set(statuses)}
        wait_until(services.idle, "every pool back to all-free (cached blocks count as free)",
                   timeout=30)
        for scheduler in services.schedulers:          # one live worker each, the killed one reaped
            assert scheduler.poll() is None and len(child_pids(scheduler.pid)) == 1
        pids = services.pids()
    finally:
        services.stop()
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), "no process left behind",
               timeout=10)
