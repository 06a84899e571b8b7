"""A scheduler whose worker stops answering (a hung device: here its process SIGSTOPped) leaves routing at once:
NOT_SERVING and out of the registry within --stall-timeout; after --step-timeout its worker is replaced, the
streams it held go on elsewhere, token for token, and it comes back."""
from __future__ import annotations

import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import router_pb2
from tests.services_fixtures import child_pids, collect, greedy, registered_schedulers, start_services, wait_until

STALL_TIMEOUT_S = 1.0
STEP_TIMEOUT_S = 5.0
PROMPT = "A worker that hangs must not hang the streams it holds: " * 3


def health_status(services, address: str) -> int:
    try:
        return health_pb2_grpc.HealthStub(services.channel(address)).Check(
            health_pb2.HealthCheckRequest(service="ferry.Scheduler"), timeout=2).status
    except grpc.RpcError:
        return -1


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list[int]:
    from base.config import EngineConfig
    from base.sampling_params import SamplingParams
    from ferry.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    return engine.generate([PROMPT], params)[0].token_ids


def test_a_hung_worker_takes_its_scheduler_out_of_routing_and_its_streams_go_on_elsewhere(tiny_llama_dir, expected):
    services = start_services(tiny_llama_dir, 2, **{"--stall-timeout": str(STALL_TIMEOUT_S),
                                                    "--step-timeout": str(STEP_TIMEOUT_S)})
    try:
        stream = services.router().Generate(router_pb2.GenerateRequest(
            text=PROMPT, sampling=greedy(300, ignore_eos=True)), timeout=120)
        received = list(next(stream).token_ids)
        holder = next(i for i, a in enumerate(services.scheduler_addresses) if services.scheduler_stats(a).num_running)
        address, hung = services.scheduler_addresses[holder], child_pids(services.schedulers[holder].pid)[0]
        os.kill(hung, signal.SIGSTOP)
        wait_until(lambda: health_status(services, address) == health_pb2.HealthCheckResponse.NOT_SERVING
                   and len(registered_schedulers(services)) == 1, "the stalled scheduler out of routing",
                   timeout=STALL_TIMEOUT_S + 10)
        received += collect(stream)[0]             # resumed on the other scheduler once the step timed out
        assert received == expected
        wait_until(lambda: health_status(services, address) == health_pb2.HealthCheckResponse.SERVING
                   and len(registered_schedulers(services)) == 2, "back in routing with a new worker", timeout=60)
        assert child_pids(services.schedulers[holder].pid) != [hung]
        wait_until(services.idle, "KV back to 0 on both schedulers", timeout=30)
    finally:
        services.stop()
