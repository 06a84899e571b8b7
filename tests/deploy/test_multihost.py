"""Ferry past one host, simulated on loopback addresses: no `ferry up`, each service launched on its own "host" as
Kubernetes would (Redis on 127.0.0.1, schedulers on 127.0.0.2 and 127.0.0.3, the router on 127.0.0.4, a scheduler
that joins later on 127.0.0.5, one watched while it waits for its Redis on 127.0.0.6). The scheduler on 127.0.0.3
binds every interface and advertises the address given by $FERRY_ADVERTISE_HOST, as a pod advertises its pod IP;
the others advertise the address they bind. Every service has the cluster token, as in a deployment: a scheduler
binding every interface refuses to start without one, and the router takes only registrations signed with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from base.cluster_auth import token_metadata
from ferry.launcher import free_port, wait_for_health
from ferry.stack import Stack
from protos import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from protos.registration import SchedulerInfo, scheduler_key, verified_registration
from tests.services_fixtures import CHILD_ENV, KV_CACHE_BYTES, collect, greedy, served_alone, wait_until

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_TTL_S = 2.0
REDIS_HOST, ROUTER_HOST = "127.0.0.1", "127.0.0.4"
MAX_TOKENS = 8
CLUSTER_TOKEN = "cluster-token-for-tests"
# what is tested here is registration and routing: workers use torch ops, not wait on a C++ kernel build
SERVICE_ENV = {**CHILD_ENV, "FERRY_CPU_KERNELS": "0", "FERRY_CLUSTER_TOKEN": CLUSTER_TOKEN}


@dataclass
class Scheduler:
    scheduler_id: str
    host: str
    port: int
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Cluster:
    model_dir: Path
    redis_url: str
    router_address: str
    metrics_url: str
    stack: Stack
    schedulers: dict[str, Scheduler] = field(default_factory=dict)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def registration(self, scheduler_id: str) -> SchedulerInfo | None:
        """The scheduler's registration, checked as the router checks it (signed with the cluster token)."""
        value = self.redis().get(scheduler_key(scheduler_id))
        return verified_registration(value, CLUSTER_TOKEN) if value is not None else None

    def start_scheduler(self, scheduler_id: str, host: str, bind: str | None = None) -> Scheduler:
        """A scheduler on `host`; with `bind`, it listens there and advertises `host` through the environment."""
        port = free_port()
        env = {**SERVICE_ENV, "FERRY_ADVERTISE_HOST": host if bind else ""}
        process = self.stack.start(self.scheduler_command(scheduler_id, bind or host, port), scheduler_id, env=env)
        scheduler = Scheduler(scheduler_id, host, port, process)
        wait_for_health(scheduler.address, Stack([scheduler.process]), timeout=180)   # others may be dead
        self.schedulers[scheduler_id] = scheduler
        return scheduler

    def scheduler_command(self, scheduler_id: str, bind: str, port: int) -> list[str]:
        return [sys.executable, "-m", "scheduler", "--host", bind, "--port", str(port), "--scheduler-id", scheduler_id,
                "--model", str(self.model_dir), "--dtype", "float32", "--device", "cpu",
                "--kv-cache-memory", str(KV_CACHE_BYTES), "--redis-url", self.redis_url,
                "--heartbeat-ttl", str(HEARTBEAT_TTL_S)]

    def generate(self, prompt: list[int]) -> list[int]:
        with grpc.insecure_channel(self.router_address) as channel:
            request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), sampling=greedy(MAX_TOKENS))
            return collect(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60))[0]

    def routed(self) -> dict[str, float]:
        """The router's count of requests sent to each scheduler id."""
        text = httpx.get(self.metrics_url, timeout=10).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "ferry:router_requests_routed")
        return {s.labels["scheduler_id"]: s.value for s in family.samples if s.name.endswith("_total")}


def start_redis(stack: Stack, port: int) -> str:
    stack.start(["redis-server", "--port", str(port), "--bind", REDIS_HOST, "--save", "", "--appendonly", "no"],
                "redis-server", stdout=subprocess.DEVNULL)
    url = f"redis://{REDIS_HOST}:{port}"
    wait_until(lambda: answers_ping(url), "redis answering", timeout=15)
    return url


def answers_ping(url: str) -> bool:
    try:
        return redis.Redis.from_url(url).ping()
    except redis.ConnectionError:
        return False


def start_router(stack: Stack, redis_url: str) -> tuple[str, str]:
    port, http_port = free_port(), free_port()
    stack.start([sys.executable, "-m", "router", "--host", ROUTER_HOST, "--port", str(port), "--redis-url", redis_url,
                 "--http-host", ROUTER_HOST, "--http-port", str(http_port)], "router", env=SERVICE_ENV)
    address = f"{ROUTER_HOST}:{port}"
    wait_for_health(address, stack, timeout=60)
    return address, f"http://{ROUTER_HOST}:{http_port}/metrics"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir) -> Cluster:
    stack = Stack()
    try:
        redis_url = start_redis(stack, free_port())
        router_address, metrics_url = start_router(stack, redis_url)
        cluster = Cluster(tiny_llama_dir, redis_url, router_address, metrics_url, stack)
        cluster.start_scheduler("host-a", "127.0.0.2")
        cluster.start_scheduler("host-b", "127.0.0.3", bind="0.0.0.0")
        yield cluster
    finally:
        stack.stop()


def distinct_prompts(count: int, offset: int) -> list[list[int]]:
    """Prompts whose first block differs, so the router's affinity spreads them over the schedulers."""
    return [[(offset + 37 * i + j) % 500 + 3 for j in range(20)] for i in range(count)]


def served_directly(scheduler: Scheduler, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(scheduler.address) as channel:
        return served_alone(scheduler_pb2_grpc.SchedulerStub(channel), prompt, greedy(MAX_TOKENS),
                            metadata=token_metadata(CLUSTER_TOKEN)).tokens("alone")


def generation_tokens(scheduler: Scheduler) -> int:
    with grpc.insecure_channel(scheduler.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return stub.Stats(scheduler_pb2.StatsRequest(), timeout=10,
                          metadata=token_metadata(CLUSTER_TOKEN)).generation_tokens_total


def test_schedulers_register_addresses_on_their_own_hosts(cluster):
    for scheduler in cluster.schedulers.values():
        info = cluster.registration(scheduler.scheduler_id)
        assert info is not None and info.address == scheduler.address


def test_readiness_service_of_the_manifest_turns_serving_only_once_registered(cluster):
    """A scheduler whose Redis is not up yet has its model loaded and answers health, but the service its readiness
    probe asks about stays not SERVING until the registration is in Redis."""
    redis_port, scheduler_port = free_port(), free_port()
    redis_url, address = f"redis://{REDIS_HOST}:{redis_port}", f"127.0.0.6:{scheduler_port}"
    command = cluster.scheduler_command("host-probe", "127.0.0.6", scheduler_port)
    command[command.index("--redis-url") + 1] = redis_url
    process = cluster.stack.start(command, "host-probe", env=SERVICE_ENV)
    wait_for_health(address, Stack([process]), timeout=180)           # model loaded, gRPC up
    service = readiness_service_in_manifest()
    deadline = time.monotonic() + 3 * HEARTBEAT_TTL_S
    while time.monotonic() < deadline:
        assert health_status(address, service) != health_pb2.HealthCheckResponse.SERVING, "ready, not registered"
        time.sleep(0.2)
    start_redis(cluster.stack, redis_port)
    wait_until(lambda: health_status(address, service) == health_pb2.HealthCheckResponse.SERVING,
               "ready once registered", timeout=30)
    assert redis.Redis.from_url(redis_url).get(scheduler_key("host-probe")) is not None
    stop_gracefully(process)


def readiness_service_in_manifest() -> str:
    manifest = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "scheduler.yaml").read_text())
    pod = next(d for d in manifest if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    return pod["containers"][0]["readinessProbe"]["grpc"]["service"]


def health_status(address: str, service: str) -> int | None:
    """The health service's answer for `service`; None while it knows no such service."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=2).status
        except grpc.RpcError:
            return None


def stop_gracefully(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(30)


def test_requests_route_end_to_end_across_hosts(cluster):
    before = {sid: generation_tokens(s) for sid, s in cluster.schedulers.items()}
    prompts = distinct_prompts(12, offset=0)
    answers = [cluster.generate(prompt) for prompt in prompts]
    assert all(len(tokens) == MAX_TOKENS for tokens in answers)
    served = {sid: generation_tokens(s) - before[sid] for sid, s in cluster.schedulers.items()}
    assert all(tokens > 0 for tokens in served.values()), f"a scheduler took no traffic: {served}"
    for scheduler in cluster.schedulers.values():   # the same greedy tokens on every host
        assert served_directly(scheduler, prompts[0]) == answers[0]


def test_a_killed_scheduler_is_dropped_within_its_heartbeat_ttl(cluster):
    victim = cluster.schedulers.pop("host-a")
    # the key expires at most one TTL after the last heartbeat: checked on Redis's clock, not on a loaded machine's
    assert 0 < cluster.redis().pttl(scheduler_key("host-a")) <= HEARTBEAT_TTL_S * 1000
    os.kill(victim.process.pid, signal.SIGKILL)    # no chance to deregister
    wait_until(lambda: cluster.registration("host-a") is None, "the dead scheduler's key to expire",
               timeout=HEARTBEAT_TTL_S + 5)
    time.sleep(1.0)                                 # the router's next refresh of the live schedulers
    routed_before = cluster.routed().get("host-a", 0)
    answers = [cluster.generate(prompt) for prompt in distinct_prompts(8, offset=100)]
    assert all(len(tokens) == MAX_TOKENS for tokens in answers)
    assert cluster.routed().get("host-a", 0) == routed_before


def test_a_new_scheduler_joins_and_takes_traffic(cluster):
    newcomer = cluster.start_scheduler("host-c", "127.0.0.5")
    wait_until(lambda: cluster.registration("host-c") is not None, "the new scheduler registered")
    time.sleep(1.0)                                 # the router's next refresh of the live schedulers
    for prompt in distinct_prompts(40, offset=200):
        assert len(cluster.generate(prompt)) == MAX_TOKENS
        if generation_tokens(newcomer) > 0:
            break
    assert generation_tokens(newcomer) > 0, "the new scheduler took none of 40 requests"
    assert cluster.routed().get("host-c", 0) > 0
