"""Real service processes for tests: redis-server on a free port, schedulers (each spawning its worker), a router."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import openai
import redis

from base.cluster_auth import token_metadata
from base.tls import TlsConfig
from ferry.launcher import free_port, wait_for_health
from ferry.stack import Stack
from protos import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

HEARTBEAT_TTL_S = 2.0
KV_CACHE_BYTES = 4_000_000          # a few hundred blocks of the tiny model
API_KEY = "sk-ferry-test"    # the key the OpenAI API tests' router requires
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "FERRY_LOG_LEVEL": "WARNING"}


@dataclass
class ServiceStack:
    redis_port: int
    redis_url: str
    router_address: str
    scheduler_addresses: list[str]
    stack: Stack
    schedulers: list[subprocess.Popen] = field(default_factory=list)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    redis_password: str = ""
    tls: TlsConfig | None = None          # channels trust tls.ca and present tls.cert
    cluster_token: str = ""               # what scheduler calls carry

    def channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = (grpc.secure_channel(address, self.tls.channel_credentials())
                                      if self.tls else grpc.insecure_channel(address))
        return self.channels[address]

    def router(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self.channel(self.router_address))

    def scheduler_stats(self, address: str) -> scheduler_pb2.StatsResponse:
        return scheduler_pb2_grpc.SchedulerStub(self.channel(address)).Stats(
            scheduler_pb2.StatsRequest(), timeout=5, metadata=token_metadata(self.cluster_token))

    def pids(self) -> list[int]:
        """Router, schedulers and their workers."""
        own = [p.pid for p in self.stack.processes if p.args[0] != "redis-server"]
        return own + [c for p in self.schedulers for c in child_pids(p.pid)]

    def idle(self) -> bool:
        """No request running or waiting on any scheduler and every block free (cached-free blocks count)."""
        for address in self.scheduler_addresses:
            stats = self.scheduler_stats(address)
            if stats.num_running or stats.num_waiting or stats.num_free_blocks != stats.num_blocks:
                return False
        return True

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, password=self.redis_password or None)

    def restart_redis(self, while_down) -> None:
        """Stop Redis, run while_down(), start an empty Redis on the same port."""
        old = next(p for p in self.stack.processes if p.args[0] == "redis-server")
        old.kill()
        old.wait()
        self.stack.processes.remove(old)
        while_down()
        start_redis(self.stack, self.redis_port, self.redis_password)

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.stack.stop()


def start_redis(stack: Stack, port: int, password: str = "") -> subprocess.Popen:
    auth = ["--requirepass", password] if password else []
    return stack.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                        "no", *auth], "redis-server", stdout=subprocess.DEVNULL)


@dataclass
class Secured:
    """What a secured stack runs with: a Redis password (routers and schedulers get it), TLS files (the services
    get them through their flags; the fixture's own calls dial with them), the cluster token the fixture's own
    scheduler calls carry, and a folder for each scheduler's log."""
    redis_password: str = ""
    tls: TlsConfig | None = None
    cluster_token: str = ""
    log_dir: Path | None = None

    def log(self, name: str):
        return open(self.log_dir / f"{name}.log", "wb") if self.log_dir else None


def matching_engine(model_dir: Path):
    """The in-process engine with start_services' flags: what a served request must give, token for token."""
    from base.config import EngineConfig
    from ferry.engine import Engine

    return Engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory=KV_CACHE_BYTES))


def cancel_beside_others(services: ServiceStack, long_prompt: str, prompts: list[str],
                         sampling: common_pb2.SamplingParams, expected: list) -> None:
    """Cancel a long stream after its first tokens while `prompts` stream beside it: theirs must be `expected`
    (the engine's results), token for token and text, and every block free again after."""
    from concurrent.futures import ThreadPoolExecutor

    long_stream = services.router().Generate(router_pb2.GenerateRequest(
        text=long_prompt, sampling=greedy(600, ignore_eos=True)))
    with ThreadPoolExecutor(len(prompts)) as pool:
        others = [pool.submit(lambda p: collect(services.router().Generate(
            router_pb2.GenerateRequest(text=p, sampling=sampling))), p) for p in prompts]
        for _ in range(5):
            next(long_stream)
        long_stream.cancel()
        results = [f.result() for f in others]
    for (token_ids, text, _), want in zip(results, expected):
        assert token_ids == want.token_ids and text == want.text
    wait_until(services.idle, "every block free again after the cancel", timeout=10)


def flag_args(flag: str, value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A flag's arguments: a switch alone (None), one value, or several (a tuple)."""
    if value is None:
        return (flag,)
    return (flag, *value) if isinstance(value, tuple) else (flag, value)


def start_services(model_dir: Path, num_schedulers: int = 2, router_flags: tuple[str, ...] = ("--http-port", "0"),
                   scheduler_env: dict[str, str] | None = None, secured: Secured = Secured(),
                   **scheduler_flags: str | tuple[str, ...] | None) -> ServiceStack:
    """scheduler_env: extra environment for the schedulers (and so their workers); a flag given None is a switch, a
    tuple several values."""
    stack = Stack()
    try:
        redis_port = free_port()
        start_redis(stack, redis_port, secured.redis_password)
        redis_url = f"redis://127.0.0.1:{redis_port}"
        auth = {"--redis-password": secured.redis_password} if secured.redis_password else {}
        flags = {"--model": str(model_dir), "--dtype": "float32", "--device": "cpu",
                 "--kv-cache-memory": str(KV_CACHE_BYTES), "--redis-url": redis_url,
                 "--heartbeat-ttl": str(HEARTBEAT_TTL_S), **auth, **scheduler_flags}
        addresses, schedulers = [], []
        for i in range(num_schedulers):
            port = free_port()
            args = [sys.executable, "-m", "scheduler", "--port", str(port), "--scheduler-id", f"sched-{i}"]
            log = secured.log(f"sched-{i}")
            args += [a for flag, value in flags.items() for a in flag_args(flag, value)]
            schedulers.append(stack.start(args, f"scheduler {i}",
                                          env={**CHILD_ENV, **(scheduler_env or {})}, stderr=log))
            if log is not None:
                log.close()   # the scheduler holds its own copy
            addresses.append(f"127.0.0.1:{port}")
        for address in addresses:
            wait_for_health(address, stack, timeout=180, tls=secured.tls)
        router_port = free_port()
        stack.start([sys.executable, "-m", "router", "--port", str(router_port), "--redis-url", redis_url,
                     *[a for kv in auth.items() for a in kv], *router_flags], "router", env=CHILD_ENV)
        router_address = f"127.0.0.1:{router_port}"
        wait_for_health(router_address, stack, timeout=60, tls=secured.tls)
        services = ServiceStack(redis_port, redis_url, router_address, addresses, stack, schedulers,
                                redis_password=secured.redis_password, tls=secured.tls,
                                cluster_token=secured.cluster_token)
        wait_until(lambda: len(registered_schedulers(services)) == num_schedulers, "schedulers registered")
        return services
    except BaseException:
        stack.stop()
        raise


def redis_answers(url: str, password: str = "") -> bool:
    try:
        return redis.Redis.from_url(url, password=password or None).ping()
    except redis.ConnectionError:
        return False


@contextmanager
def running_redis(password: str = "") -> Iterator[str]:
    """A redis-server on a free port while the block runs; yields its URL."""
    stack, port = Stack(), free_port()
    start_redis(stack, port, password)
    url = f"redis://127.0.0.1:{port}"
    try:
        wait_until(lambda: redis_answers(url, password), "redis-server up")
        yield url
    finally:
        stack.stop()


def registered_schedulers(services: ServiceStack) -> list[bytes]:
    try:
        return list(services.redis().scan_iter(match="ferry:scheduler:*"))
    except redis.ConnectionError:   # Redis still starting
        return []


def child_pids(pid: int) -> list[int]:
    """A process's children (a scheduler's: its worker)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def indexed_blocks(redis_client: redis.Redis, scheduler_id: str) -> list[int]:
    """The block hashes the prefix index says scheduler_id holds."""
    return [int(h) for h in redis_client.smembers(f"ferry:blocks:{scheduler_id}")]


def wait_until(predicate, what: str, timeout: float = 30.0, explain=lambda: "") -> None:
    """explain: what the failure message adds (the state that was waited on)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what} {explain()}".rstrip())
        time.sleep(0.05)


FERRY = str(Path(sys.executable).parent / "ferry")


@contextmanager
def ferry_up(flags: list[str], threads: int = 1) -> Iterator[tuple[grpc.Channel, int]]:
    """`ferry up` with these flags on its own gRPC port, once it says it is ready: (a channel to its router, its
    pid); SIGTERM at the end."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "FERRY_LOG_LEVEL": "WARNING"}
    up = subprocess.Popen([FERRY, "up", "--port", str(port), *flags], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in up.stdout:
        lines.append(line)
        if line.startswith("[ferry] ready"):
            break
    else:
        raise AssertionError("ferry up exited before it was ready:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()   # keep its pipe drained
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, up.pid
    finally:
        channel.close()
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)


def greedy(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def collect(responses) -> tuple[list[int], str, list[router_pb2.GenerateResponse]]:
    messages = list(responses)
    return ([t for m in messages for t in m.token_ids], "".join(m.text for m in messages), messages)


class ConnectStream:
    """A Scheduler.Connect stream driven by hand: submit and abort at any time, read what comes back, message by
    message, into per-request tokens, finished samples and errors."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, timeout: float = 60,
                 metadata: list[tuple[str, str]] | None = None):
        self.outgoing: queue.Queue = queue.Queue()
        self.call = stub.Connect(iter(self.outgoing.get, None), timeout=timeout, metadata=metadata)
        self.messages: list[scheduler_pb2.ConnectResponse] = []
        self.outputs: dict[str, list[scheduler_pb2.ScheduleResponse]] = defaultdict(list)
        self.finished: dict[str, set[int]] = defaultdict(set)
        self.errors: dict[str, scheduler_pb2.RequestFailure] = {}

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: common_pb2.SamplingParams,
               lora_name: str = "", kv_source: scheduler_pb2.KvSource | None = None) -> None:
        request = scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                                sampling=sampling, lora_name=lora_name, kv_source=kv_source)
        self.outgoing.put(scheduler_pb2.ConnectRequest(submit=scheduler_pb2.SubmitRequest(request=request)))

    def abort(self, request_id: str) -> None:
        self.outgoing.put(scheduler_pb2.ConnectRequest(abort=scheduler_pb2.AbortRequest(request_id=request_id)))

    def done_sending(self) -> None:
        self.outgoing.put(None)

    def cancel(self) -> None:
        self.call.cancel()
        self.done_sending()   # lets the thread that sends the requests go

    def read_until(self, predicate) -> None:
        while not predicate():
            self.record(next(self.call))

    def read_to_the_end(self) -> None:
        for message in self.call:
            self.record(message)

    def record(self, message: scheduler_pb2.ConnectResponse) -> None:
        self.messages.append(message)
        for event in message.events:
            if event.HasField("error"):
                self.errors[event.request_id] = event.error
                continue
            self.outputs[event.request_id].append(event.output)
            if event.output.finish_reason:
                self.finished[event.request_id].add(event.output.index)

    def tokens(self, request_id: str) -> list[int]:
        return [t for output in self.outputs[request_id] for t in output.token_ids]

    def done(self, request_id: str, num_samples: int = 1) -> bool:
        return len(self.finished[request_id]) == num_samples or request_id in self.errors


def served_alone(stub: scheduler_pb2_grpc.SchedulerStub, prompt_token_ids: list[int],
                 sampling: common_pb2.SamplingParams, request_id: str = "alone", timeout: float = 60,
                 metadata: list[tuple[str, str]] | None = None) -> ConnectStream:
    """One request on a Connect stream of its own, read to the stream's end (its outputs, or its error)."""
    stream = ConnectStream(stub, timeout, metadata)
    stream.submit(request_id, prompt_token_ids, sampling)
    stream.done_sending()
    stream.read_to_the_end()
    return stream


@dataclass
class HttpStack:
    services: ServiceStack
    base_url: str
    model: str
    grpc_address: str = ""

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60)

    def post(self, path: str, body: dict | bytes, api_key: str | None = API_KEY,
             timeout: httpx.Timeout | float = 60) -> httpx.Response:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.base_url + path, content=content, headers=headers, timeout=timeout)

    def generated_tokens(self) -> int:
        return sum(self.services.scheduler_stats(a).generation_tokens_total for a in self.services.scheduler_addresses)

    def idle(self) -> bool:
        return self.services.idle()


@contextmanager
def start_http_stack(model_dir: Path, router_flags: tuple[str, ...] = (),
                     **scheduler_flags: str | tuple[str, ...] | None) -> Iterator[HttpStack]:
    """redis-server, one scheduler with its worker, and a router serving gRPC and the OpenAI API over HTTP."""
    services = start_services(model_dir, num_schedulers=1, **scheduler_flags)
    try:
        grpc_port, http_port = free_port(), free_port()
        services.stack.start([sys.executable, "-m", "router", "--port", str(grpc_port), "--redis-url",
                              services.redis_url, "--http-port", str(http_port), "--api-key", API_KEY,
                              *router_flags], "router with HTTP", env=CHILD_ENV)
        wait_for_health(f"127.0.0.1:{grpc_port}", services.stack, timeout=60)
        base_url = f"http://127.0.0.1:{http_port}/v1"
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200, "HTTP health")
        yield HttpStack(services, base_url, model_dir.name, f"127.0.0.1:{grpc_port}")
    finally:
        services.stop()


def build_scripted_model(path: Path, script: list[str], chat_template: str, special: tuple[str, ...] = ()) -> Path:
    """A tiny Llama whose next token depends only on the current one, wired so that after any chat prompt it says
    the script (each piece an added token; those in `special` special ones, which detokenizing skips by default)
    and ends: a real model through a real stack, with known output."""
    import torch
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.common.random_models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(path)
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=piece in special) for piece in script])
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    prompt_end = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    chain = [prompt_end, *tokenizer.convert_tokens_to_ids(script), tokenizer.eos_token_id]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()     # no attention, no MLP: the residual is the token's embedding
        layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.normal_(0.0, 0.02)
        model.lm_head.weight.zero_()
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, i] = 8.0     # RMS 1: the norm leaves it as it is
            model.lm_head.weight[following, i] = 8.0
    model.save_pretrained(path, safe_serialization=True)
    return path
