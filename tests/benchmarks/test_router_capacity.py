"""`ferry bench router` (issue 21): the real router between a synthetic scheduler and clients in another process."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(path)
    return path


def run_router_bench(tokenizer_dir, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "router", "--model", str(tokenizer_dir),
                          "--duration", "1", "--max-tokens", "12", "--step-interval", "0.005", "--json", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_token_arrives_over_grpc_sse_and_http_with_its_cost_and_latency(tokenizer_dir):
    result = run_router_bench(tokenizer_dir, "--clients", "2,4")
    assert [(r["api"], r["clients"]) for r in result["runs"]] == [
        ("grpc", 2), ("sse", 2), ("http", 2), ("grpc", 4), ("sse", 4), ("http", 4)]
    for run in result["runs"]:
        assert run["failed"] == 0 and run["incomplete_requests"] == 0, run
        assert run["requests"] >= run["clients"] and run["tokens"] == 12 * run["requests"], run
        assert run["latency_samples"] == run["tokens"], run   # every token matched to its send time
        assert run["router_cpu_us_per_token"] > 0 and run["added_latency_ms_p99"] >= run["added_latency_ms_p50"]
    http = [r for r in result["runs"] if r["api"] == "http"]
    assert all(r["tokens_per_message"] == 12 for r in http)


def test_stream_interval_reaches_grpc_and_sse_clients(tokenizer_dir):
    result = run_router_bench(tokenizer_dir, "--clients", "2", "--apis", "grpc,sse", "--stream-interval", "4")
    for run in result["runs"]:
        assert run["failed"] == 0 and run["incomplete_requests"] == 0, run
        assert run["tokens_per_message"] >= 4, run   # 12 tokens: 3 messages of 4 each
