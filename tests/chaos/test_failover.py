"""A crashed worker or scheduler loses no request that another scheduler could have served, and cuts no stream:
real schedulers, workers, Redis and router; workers and schedulers SIGKILLed mid-run, or workers killed by a
poisoned request (gpu_worker/fault.py)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from base.sampling_params import SamplingParams
from ferry.launcher import free_port
from gpu_worker.fault import CRASH_ON_TOKEN_ENV
from protos import common_pb2, router_pb2
from router.tokenizer import load_tokenizer
from tests.services_fixtures import ServiceStack, child_pids, greedy, start_services, wait_until

PROMPTS = [f"Failover prompt {i}: a crashed worker loses nothing" for i in range(6)]
MAX_TOKENS = 64                           # long enough that a kill finds streams mid-way
KINDS = ("grpc", "sse", "http")          # streamed over gRPC, streamed over HTTP (SSE), held to the end (HTTP)
SEED = 1234                               # the "seeded" kind: sampled at temperature 1 with this seed, over gRPC
POISON = 300                              # a token id the fault-injected workers die on


@dataclass
class Cluster:
    services: ServiceStack
    http: str

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.http + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        return sum(v for (n, sample_labels), v in self.metrics().items()
                   if n == name and set(labels.items()) <= set(sample_labels))

    def breaker_states(self) -> dict[str, int]:
        return {dict(labels)["scheduler_id"]: int(v) for (n, labels), v in self.metrics().items()
                if n == "ferry:router_breaker_state"}

    def worker_of(self, index: int) -> int:
        return child_pids(self.services.schedulers[index].pid)[0]

    def stop(self) -> None:
        self.services.stop()


def start_cluster(model_dir, num_schedulers: int, *router_flags: str, scheduler_env: dict | None = None,
                  **scheduler_flags: str) -> Cluster:
    http_port = free_port()
    services = start_services(model_dir, num_schedulers, ("--http-port", str(http_port), "--policy", "round_robin",
                                                           *router_flags), scheduler_env, **scheduler_flags)
    cluster = Cluster(services, f"http://127.0.0.1:{http_port}")
    wait_until(lambda: httpx.get(cluster.http + "/health").status_code == 200, "HTTP health")
    return cluster


@dataclass
class Outcome:
    kind: str
    prompt: int
    ok: bool
    text: str = ""                            # what reached the client
    token_ids: list[int] = field(default_factory=list)   # gRPC only
    num_tokens: int = 0                       # tokens that reached the client
    error: str = ""                           # status / error event message
    status: str = ""                          # gRPC code name or HTTP status
    seconds: float = 0.0


def run_grpc(cluster: Cluster, prompt: int, max_tokens: int, seed: int | None = None) -> Outcome:
    outcome = Outcome("grpc" if seed is None else "seeded", prompt, False)
    sampling = (greedy(max_tokens, ignore_eos=True) if seed is None else
                common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True))
    call = cluster.services.router().Generate(router_pb2.GenerateRequest(text=PROMPTS[prompt], sampling=sampling),
                                              timeout=120)
    try:
        for message in call:
            outcome.token_ids += message.token_ids
            outcome.text += message.text
        outcome.ok, outcome.status = True, "OK"
    except grpc.RpcError as e:
        outcome.status, outcome.error = e.code().name, e.details() or ""
    outcome.num_tokens = len(outcome.token_ids)
    return outcome


def run_sse(cluster: Cluster, prompt: int, max_tokens: int) -> Outcome:
    """logprobs=0 makes every token its own event, so the client sees each one as it is sent."""
    outcome = Outcome("sse", prompt, False)
    body = {"prompt": PROMPTS[prompt], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    with httpx.stream("POST", cluster.http + "/v1/completions", json=body, timeout=120) as response:
        outcome.status = str(response.status_code)
        if response.status_code != 200:
            outcome.error = json.loads(response.read())["error"]["message"]
            return outcome
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    for event in map(json.loads, events[:-1]):
        if "error" in event:
            outcome.error = event["error"]["message"]
            return outcome
        outcome.text += event["choices"][0]["text"]
        outcome.num_tokens += len(event["choices"][0]["logprobs"]["tokens"])
    outcome.ok = True
    return outcome


def run_http(cluster: Cluster, prompt: int | list[int], max_tokens: int) -> Outcome:
    outcome = Outcome("http", prompt if isinstance(prompt, int) else -1, False)
    body = {"prompt": PROMPTS[prompt] if isinstance(prompt, int) else prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    response = httpx.post(cluster.http + "/v1/completions", json=body, timeout=120)
    outcome.status = str(response.status_code)
    if response.status_code != 200:
        outcome.error = response.json()["error"]["message"]
        return outcome
    outcome.ok, outcome.text = True, response.json()["choices"][0]["text"]
    outcome.num_tokens = response.json()["usage"]["completion_tokens"]
    return outcome


RUNNERS = {"grpc": run_grpc, "sse": run_sse, "http": run_http,
           "seeded": lambda cluster, prompt, max_tokens: run_grpc(cluster, prompt, max_tokens, SEED)}


def timed(run, *args) -> Outcome:
    started = time.monotonic()
    outcome = run(*args)
    outcome.seconds = time.monotonic() - started
    return outcome


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> tuple[list[list[int]], list[str]]:
    """The engine's greedy tokens for each prompt, and their text as the router renders it."""
    from base.config import EngineConfig
    from ferry.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    token_ids = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                               ignore_eos=True))]
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    return token_ids, [tokenizer.decode(ids) for ids in token_ids]


@pytest.fixture(scope="module")
def expected_seeded(tiny_llama_dir) -> list[list[int]]:
    """The engine's tokens for each prompt sampled with SEED: a seeded draw depends only on the seed and the
    position, so any scheduler, batch or resumption gives these."""
    from base.config import EngineConfig
    from ferry.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, ignore_eos=True)
    return [r.token_ids for r in engine.generate(PROMPTS, params)]


def busy(cluster: Cluster, index: int) -> bool:
    stats = cluster.services.scheduler_stats(cluster.services.scheduler_addresses[index])
    return stats.num_running >= 2 and stats.num_waiting >= 1


def busy_mid_stream(cluster: Cluster, index: int, longest_prompt: int) -> bool:
    """Busy, and its running requests well into their answers but far from done: on average 12 to 32 tokens in, so
    a kill now cuts streams whose text has reached their clients (a kill during the first steps of a fresh batch
    cuts none: the router holds back text that is not yet whole characters, and retries the streams that sent
    nothing; one near their end finds them finished)."""
    stats = cluster.services.scheduler_stats(cluster.services.scheduler_addresses[index])
    started, far_from_done = (stats.num_running * (longest_prompt + tokens) for tokens in (12, MAX_TOKENS - 16))
    return stats.num_running >= 2 and stats.num_waiting >= 1 and started <= stats.running_tokens <= far_from_done


def steady_stream(cluster: Cluster, count: int, find_victim, kill, kinds: tuple[str, ...] = KINDS) -> list[Outcome]:
    """count requests of the kinds, 12 at a time; kill(victim) runs once, as soon as find_victim() names one."""
    cases = [(kinds[i % len(kinds)], i % len(PROMPTS)) for i in range(count)]
    killed = threading.Event()

    def watch() -> None:   # polled often: the moment a victim qualifies lasts a few steps of a tiny model
        deadline, victim = time.monotonic() + 120, None
        while victim is None and time.monotonic() < deadline:
            victim = find_victim()
            time.sleep(0.01)
        if victim is not None:
            kill(victim)
            killed.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(lambda case: timed(RUNNERS[case[0]], cluster, case[1], MAX_TOKENS), cases))
    watcher.join(timeout=5)
    assert killed.is_set(), "the worker was never killed: the test proved nothing"
    return outcomes


def test_killed_worker_loses_no_request_and_cuts_no_stream(tiny_llama_dir, expected):
    expected_ids, expected_text = expected
    cluster = start_cluster(tiny_llama_dir, 2, **{"--max-num-seqs": "3"})   # queues form; of 3 running, one streams
    try:
        workers = [cluster.worker_of(0), cluster.worker_of(1)]
        longest_prompt = max(len(load_tokenizer(str(tiny_llama_dir)).encode(p)) for p in PROMPTS)
        victims = []   # the first scheduler seen busy mid-stream: round robin need not keep both as busy

        def find_victim() -> int | None:
            return next((i for i in (0, 1) if busy_mid_stream(cluster, i, longest_prompt)), None)

        def kill(index: int) -> None:
            victims.append(index)
            os.kill(workers[index], signal.SIGKILL)
        outcomes = steady_stream(cluster, 96, find_victim, kill)
        check_every_answer_whole(outcomes, expected)   # those running went on with the new worker, resumed there
        resumes, retries = cluster.metric("ferry:router_resumes_total"), cluster.metric("ferry:router_retries_total")
        assert cluster.metric("ferry:router_failovers_total") == retries + resumes   # refused while it restarted
        assert cluster.metric("ferry:request_success_total") == sum(o.ok for o in outcomes)
        wait_until(cluster.services.idle, "KV back to 0 on both schedulers", timeout=30)
        assert cluster.worker_of(victims[0]) != workers[victims[0]]
    finally:
        cluster.stop()


def check_every_answer_whole(outcomes: list[Outcome], expected, expected_seeded=None) -> None:
    """Exactly the engine's answer, once: no token lost, repeated, or from two attempts, though some streams
    were cut mid-way and resumed elsewhere."""
    expected_ids, expected_text = expected
    for o in outcomes:
        assert o.ok, o
        if o.kind == "seeded":
            assert o.token_ids == expected_seeded[o.prompt], o
        else:
            assert o.text == expected_text[o.prompt] and o.num_tokens == MAX_TOKENS, o
            assert o.kind != "grpc" or o.token_ids == expected_ids[o.prompt], o


def test_streams_of_a_killed_scheduler_resume_on_another_token_for_token(tiny_llama_dir, expected, expected_seeded):
    cluster = start_cluster(tiny_llama_dir, 2, **{"--max-num-seqs": "3"})
    try:
        longest_prompt = max(len(load_tokenizer(str(tiny_llama_dir)).encode(p)) for p in PROMPTS)
        victims = []

        def find_victim() -> int | None:
            return next((i for i in (0, 1) if busy_mid_stream(cluster, i, longest_prompt)), None)

        def kill(index: int) -> None:
            victims.append(index)
            os.kill(cluster.services.schedulers[index].pid, signal.SIGKILL)
        outcomes = steady_stream(cluster, 48, find_victim, kill, kinds=("grpc", "seeded", "sse"))
        check_every_answer_whole(outcomes, expected, expected_seeded)
        assert cluster.metric("ferry:router_resumes_total") >= 1, "no stream was cut mid-way: the kill came too late"
        survivor = cluster.services.scheduler_addresses[1 - victims[0]]

        def survivor_idle() -> bool:
            stats = cluster.services.scheduler_stats(survivor)
            return not (stats.num_running or stats.num_waiting) and stats.num_free_blocks == stats.num_blocks
        wait_until(survivor_idle, "KV back to 0 on the surviving scheduler", timeout=30)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def expected_long(tiny_llama_dir) -> list[str]:
    """The router's text of each prompt's LONG greedy tokens."""
    from base.config import EngineConfig
    from ferry.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True))
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    return [tokenizer.decode(r.token_ids) for r in results]


LONG = 400


def test_a_lone_schedulers_requests_go_on_with_its_new_worker_when_the_old_one_is_killed(tiny_llama_dir,
                                                                                       expected_long):
    cluster = start_cluster(tiny_llama_dir, 1, **{"--max-num-seqs": "2"})
    try:
        victim = cluster.worker_of(0)
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(timed, RUNNERS[KINDS[i % 3]], cluster, i, LONG) for i in range(6)]
            wait_until(lambda: busy(cluster, 0), "the scheduler busy", timeout=60)
            os.kill(victim, signal.SIGKILL)
            outcomes = [f.result(timeout=120) for f in futures]
        for o in outcomes:   # nothing failed, nothing repeated: each resumed from the tokens it had
            assert o.ok and o.text == expected_long[o.prompt] and o.num_tokens == LONG, o
        assert cluster.metric("ferry:router_retries_total") == 0 and cluster.metric("ferry:router_resumes_total") == 0
        assert cluster.worker_of(0) != victim
        wait_until(cluster.services.idle, "KV back to 0", timeout=30)
    finally:
        cluster.stop()


def test_a_query_of_death_fails_alone_on_its_scheduler_and_reaches_no_other(tiny_llama_dir, expected):
    """It crashes its worker, then (on trial alone) the new one; then it is failed (500, not retried), while the
    requests streaming beside it on that scheduler go on untouched."""
    expected_ids, expected_text = expected
    cluster = start_cluster(tiny_llama_dir, 3, scheduler_env={CRASH_ON_TOKEN_ENV: str(POISON)})
    try:
        workers = [cluster.worker_of(i) for i in range(3)]
        with ThreadPoolExecutor(7) as pool:
            others = [pool.submit(timed, run_grpc, cluster, i, MAX_TOKENS) for i in range(6)]
            poisoned = run_http(cluster, [10, 11, POISON], 4)
            outcomes = [f.result(timeout=120) for f in others]
        assert poisoned.status == "500" and "the worker crashed running this request" in poisoned.error, poisoned
        assert all(o.ok and o.token_ids == expected_ids[o.prompt] for o in outcomes), outcomes
        replaced = [i for i in range(3) if cluster.worker_of(i) != workers[i]]
        assert len(replaced) == 1, replaced               # its own scheduler's worker, never another's
        assert cluster.metric("ferry:router_retries_total") == 0
        assert set(cluster.breaker_states().values()) <= {0}
        wait_until(cluster.services.idle, "KV back to 0", timeout=30)
    finally:
        cluster.stop()
