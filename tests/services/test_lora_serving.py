"""Multi-LoRA through `ferry up` (two schedulers): the base model and adapters of ranks 8, 16 and 64 served at once
(through the router, and in one batch on one scheduler), each token-exact against PEFT's merged model; /v1/models
lists the adapters with their base; adapters load and unload at run time under traffic with no request failed; a
killed worker loads its adapters again; unknown adapters are a 404 naming them, bad ones refused with the reason;
the admin routes need an API key where keys are configured."""
from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from base.cluster_auth import token_metadata
from ferry.launcher import free_port
from protos import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import transformers_greedy
from tests.engine_fixtures import random_prompts
from tests.lora_fixtures import build_peft_adapter, merged_model
from tests.services_fixtures import ConnectStream, child_pids, collect, ferry_up, greedy

API_KEY = "sk-lora-test"
CLUSTER_TOKEN = "lora-test-cluster-token"
MAX_TOKENS = 8
RANKS = {"a8": 8, "a16": 16, "a64": 64, "late": 16}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served_adapters")
    return {name: str(build_peft_adapter(tiny_llama_dir, root / name, rank, seed=rank + 7 * len(name)))
            for name, rank in RANKS.items()}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(seed=11, count=8, lengths=range(4, 40))


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters, prompts) -> dict[str, list[list[int]]]:
    return {name: transformers_greedy(merged_model(tiny_llama_dir, adapters.get(name)), prompts, MAX_TOKENS)
            for name in ["", *adapters]}


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, adapters):
    http_port = free_port()
    modules = [f"{name}={adapters[name]}" for name in ("a8", "a16", "a64")]
    with ferry_up(["--http-port", str(http_port), "--heartbeat-ttl", "2", "--model", str(tiny_llama_dir), "--dtype",
                   "float32", "--device", "cpu", "--kv-cache-memory", str(1 << 22), "--num-schedulers", "2",
                   "--api-key", API_KEY, "--cluster-token", CLUSTER_TOKEN, "--enable-lora", "--max-loras", "3",
                   "--max-lora-rank", "64", "--lora-modules", *modules]) as (channel, pid):
        yield router_pb2_grpc.RouterStub(channel), f"http://127.0.0.1:{http_port}", pid


def stream(router, prompt: list[int], model: str = ""):
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                         sampling=greedy(MAX_TOKENS, ignore_eos=True), model=model)
    return router.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=120)


def generate(router, prompt: list[int], model: str = "") -> list[int]:
    return collect(stream(router, prompt, model))[0]


def post(base: str, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=120)


def test_base_and_three_adapters_served_together_match_peft_merged_models(stack, prompts, references):
    router, _, _ = stack
    names = ["", "a8", "a16", "a64"]
    jobs = [(i, names[i % 4]) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outputs = list(pool.map(lambda job: generate(router, prompts[job[0]], job[1]), jobs))
    for (i, name), tokens in zip(jobs, outputs):
        assert tokens == references[name][i], f"prompt {i} with adapter {name!r}"


def scheduler_addresses(up_pid: int) -> list[str]:
    """The schedulers `ferry up` started, by the --port they were given."""
    addresses = []
    for pid in child_pids(up_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "scheduler" in argv and "--port" in argv:
            addresses.append(f"127.0.0.1:{argv[argv.index('--port') + 1]}")
    return addresses


def test_base_and_three_adapters_run_in_one_batch_on_one_scheduler(stack, tiny_llama_dir, adapters, prompts):
    """Straight to one scheduler of the stack: four requests (the base model, a8, a16, a64) run in one batch, so
    every step of theirs computes all four models' rows together, each token-exact."""
    _, _, up_pid = stack
    long, names = 48, ["", "a8", "a16", "a64"]
    expected = {name: transformers_greedy(merged_model(tiny_llama_dir, adapters.get(name)), [prompts[i]], long)[0]
                for i, name in enumerate(names)}
    metadata = token_metadata(CLUSTER_TOKEN)
    with grpc.insecure_channel(scheduler_addresses(up_pid)[0]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stream = ConnectStream(stub, metadata=metadata)
        for i, name in enumerate(names):
            stream.submit(f"batch-{i}", prompts[i], greedy(long, ignore_eos=True), lora_name=name)
        reader = threading.Thread(target=stream.read_until, args=(lambda: all(stream.done(f"batch-{i}")
                                                                                for i in range(4)),))
        reader.start()
        batches = set()
        while reader.is_alive():
            stats = stub.Stats(scheduler_pb2.StatsRequest(), metadata=metadata)
            batches.add((stats.num_running, tuple(stats.running_lora_adapters)))
        reader.join()
        stream.cancel()
    assert (4, ("a16", "a64", "a8")) in batches
    assert {name: stream.tokens(f"batch-{i}") for i, name in enumerate(names)} == expected


def test_models_lists_the_adapters_with_their_base(stack, tiny_llama_dir):
    _, base, _ = stack
    listed = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]
    parents = {m["id"]: m["parent"] for m in listed}
    base_name = Path(tiny_llama_dir).name
    assert parents == {base_name: None, "a8": base_name, "a16": base_name, "a64": base_name}


def test_an_unknown_adapter_is_a_404_naming_it(stack):
    router, base, _ = stack
    response = post(base, "/v1/completions", {"model": "no-such-adapter", "prompt": [5, 6, 7], "max_tokens": 2})
    assert response.status_code == 404 and "no-such-adapter" in response.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as refused:
        generate(router, [5, 6, 7], "no-such-adapter")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-adapter" in refused.value.details()


def test_a_bad_adapter_is_refused_at_load_with_the_reason(stack, tmp_path):
    _, base, _ = stack
    refused = post(base, "/v1/load_lora_adapter", {"lora_name": "nothing", "lora_path": str(tmp_path)})
    assert refused.status_code == 400 and "adapter_config.json" in refused.json()["error"]["message"]
    unauthorized = post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, key=None)
    assert unauthorized.status_code == 401
    missing = post(base, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert missing.status_code == 404


def test_loading_and_unloading_under_traffic_fails_no_request(stack, adapters, prompts, references):
    """Base-model traffic runs throughout; an adapter is loaded and used; another is unloaded while its requests
    run: those finish exactly, and only requests sent after the unload are refused (404)."""
    router, base, _ = stack
    failures, stop = [], threading.Event()

    def base_traffic() -> None:
        i = 0
        while not stop.is_set():
            try:
                if generate(router, prompts[i % len(prompts)]) != references[""][i % len(prompts)]:
                    failures.append(f"base prompt {i % len(prompts)}: wrong tokens")
            except grpc.RpcError as e:
                failures.append(f"base: {e.code().name} {e.details()}")
            i += 1
    sender = threading.Thread(target=base_traffic)
    sender.start()
    try:
        loaded = post(base, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
        assert loaded.status_code == 200, loaded.text
        assert [generate(router, p, "late") for p in prompts[:3]] == references["late"][:3]
        running = [stream(router, prompts[i], "a16") for i in range(4)]
        first = [list(next(responses).token_ids) for responses in running]   # each has begun on a scheduler
        unloaded = post(base, "/v1/unload_lora_adapter", {"lora_name": "a16"})
        assert unloaded.status_code == 200, unloaded.text
        assert [f + collect(rest)[0] for f, rest in zip(first, running)] == references["a16"][:4]
        response = post(base, "/v1/completions", {"model": "a16", "prompt": [5, 6, 7], "max_tokens": 2})
        assert response.status_code == 404
    finally:
        stop.set()
        sender.join()
    assert not failures


def test_a_killed_worker_loads_its_adapters_again_and_its_requests_go_on_token_for_token(stack, tiny_llama_dir,
                                                                                         adapters, prompts,
                                                                                         references):
    """Both schedulers' workers are killed while a request runs with an adapter: it resumes on a new worker, which
    loaded the scheduler's adapters again, with the tokens PEFT's merged model gives."""
    router, _, up_pid = stack
    long = 160
    expected = transformers_greedy(merged_model(tiny_llama_dir, adapters["a8"]), [prompts[2]], long)[0]
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompts[2]), model="a8",
                                         sampling=greedy(long, ignore_eos=True))
    responses = router.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=300)
    first = list(next(responses).token_ids)
    workers = [pid for scheduler in child_pids(up_pid) for pid in child_pids(scheduler)
               if b"gpu_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    assert first + collect(responses)[0] == expected
    assert [generate(router, prompts[3], "a64") for _ in range(2)] == [references["a64"][3]] * 2
    # the request's scheduler noticed (an idle one notices at its next step): it runs a new worker
    assert {pid for scheduler in child_pids(up_pid) for pid in child_pids(scheduler)} - set(workers)
