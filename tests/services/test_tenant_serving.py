"""Tenants and priorities through the services: a key file maps keys to tenants, a gateway key names them in a
header, --tenant-config bounds priorities and caps a tenant, the metrics count by tenant, and a scheduler under
`--scheduling-policy priority` serves a priority-0 request before priority-1 ones queued ahead of it."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import grpc
import httpx
import pytest

from protos import router_pb2
from tests.services_fixtures import collect, free_port, greedy, start_services, wait_until

KEYS = {"sk-search": "search", "sk-batch": "batch", "sk-gateway": "*", "sk-capped": "capped"}
TENANT_CONFIG = {"tenants": {"search": {"priority": [0, 0], "weight": 2}, "batch": {"priority": [1, 5]},
                             "capped": {"max_concurrent_requests": 1}}}
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("".join(f"{key} {tenant}\n" for key, tenant in KEYS.items()))
    http_port = free_port()
    stack = start_services(tiny_llama_dir, num_schedulers=1,
                           router_flags=("--http-port", str(http_port), "--api-key-file", str(key_file),
                                         "--tenant-config", json.dumps(TENANT_CONFIG)),
                           **{"--scheduling-policy": "priority", "--max-num-seqs": "1",
                              "--metrics-port": str(METRICS_PORT)})
    base = f"http://127.0.0.1:{http_port}"
    wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, "HTTP health")
    yield base, stack
    stack.stop()


@pytest.fixture(scope="module")
def http_base(served):
    return served[0]


def complete(base: str, key: str, max_tokens: int = 4, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      json={"prompt": "the tenants of a shared server", "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0, **body})


def metric(text: str, name: str, **labels: str) -> float:
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(label in line for label in wanted))


def test_a_keys_tenant_and_a_gateways_named_tenant_are_counted_by_name(http_base):
    assert complete(http_base, "sk-search").status_code == 200
    assert complete(http_base, "sk-gateway", headers={"x-ferry-tenant": "team-x"}).status_code == 200
    router_metrics = httpx.get(f"{http_base}/metrics").text
    for tenant in ("search", "team-x"):
        assert metric(router_metrics, "ferry:tenant_requests_total", tenant=tenant, outcome="finished") >= 1
        assert metric(router_metrics, "ferry:tenant_time_to_first_token_seconds_count", tenant=tenant) >= 1
    scheduler_metrics = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics").read().decode()
    assert metric(scheduler_metrics, "ferry:tenant_queue_time_seconds_count", tenant="search") >= 1


def test_only_a_gateway_may_name_a_tenant(http_base):
    refused = complete(http_base, "sk-search", headers={"x-ferry-tenant": "batch"})
    assert refused.status_code == 403 and "x-ferry-tenant" in refused.json()["error"]["message"]
    bad = complete(http_base, "sk-gateway", headers={"x-ferry-tenant": "no spaces allowed"})
    assert bad.status_code == 400 and "x-ferry-tenant" in bad.json()["error"]["message"]


def test_a_priority_outside_the_tenants_range_is_refused_naming_the_field(http_base):
    refused = complete(http_base, "sk-batch", priority=0)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "priority" and "[1, 5]" in refused.json()["error"]["message"]
    assert complete(http_base, "sk-batch", priority=3).status_code == 200   # and it keeps serving


def test_a_tenant_at_its_cap_gets_429_with_retry_after(http_base):
    with httpx.stream("POST", f"{http_base}/v1/completions", timeout=120,
                      headers={"Authorization": "Bearer sk-capped"},
                      json={"prompt": "a long one", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as first:
        lines = first.iter_lines()   # kept: a dropped iterator closes the stream
        next(lines)
        second = complete(http_base, "sk-capped")
        assert second.status_code == 429 and second.headers["Retry-After"] == "1"
        assert "capped" in second.json()["error"]["message"]
    # its stream was closed: the router aborts it, and the cap is free again
    wait_until(lambda: complete(http_base, "sk-capped").status_code == 200, "the cap freed", timeout=30)


def test_a_better_priority_is_served_before_worse_ones_queued_ahead_of_it(http_base):
    """One seat (--max-num-seqs 1): while a long priority-1 request runs, two more priority-1 ones queue, then a
    priority-0 one; it finishes before both."""
    finished: list[str] = []

    def send(name: str, key: str, priority: int, max_tokens: int) -> None:
        assert complete(http_base, key, max_tokens=max_tokens, priority=priority).status_code == 200
        finished.append(name)

    with httpx.stream("POST", f"{http_base}/v1/completions", timeout=120,
                      headers={"Authorization": "Bearer sk-batch"},
                      json={"prompt": "hold the seat", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                            "priority": 1}) as holder:
        lines = holder.iter_lines()
        next(lines)
        threads = [threading.Thread(target=send, args=(f"batch{i}", "sk-batch", 1, 8)) for i in range(2)]
        for thread in threads:
            thread.start()
            time.sleep(0.3)
        threads.append(threading.Thread(target=send, args=("search", "sk-search", 0, 8)))
        threads[-1].start()
        for _ in lines:
            pass
    for thread in threads:
        thread.join()
    assert finished.index("search") < finished.index("batch0")
    assert finished.index("search") < finished.index("batch1")


def test_grpc_callers_name_their_tenant_and_priority_in_metadata_and_the_request(served):
    http_base, stack = served
    request = router_pb2.GenerateRequest(text="the tenants of a shared server", priority=2,
                                         sampling=greedy(3, ignore_eos=True))
    gateway = (("authorization", "Bearer sk-gateway"), ("x-ferry-tenant", "grpc-team"))
    token_ids, _, _ = collect(stack.router().Generate(request, metadata=gateway, timeout=60))
    assert len(token_ids) == 3
    assert metric(httpx.get(f"{http_base}/metrics").text, "ferry:tenant_requests_total", tenant="grpc-team",
                  outcome="finished") == 1
    with pytest.raises(grpc.RpcError) as refused:
        collect(stack.router().Generate(request, metadata=(("authorization", "Bearer sk-search"),), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 0]" in refused.value.details()
