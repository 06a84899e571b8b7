"""Waiting for a freshly started gRPC service: poll its standard health check until it says SERVING."""
from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

POLL_INTERVAL_S = 0.1
SERVING = health_pb2.HealthCheckResponse.SERVING


class NotServing(RuntimeError):
    """The service's process exited, or it did not answer SERVING in time."""


def wait_until_serving(address: str, why_exited: Callable[[], str | None], timeout: float,
                       credentials: grpc.ChannelCredentials | None = None) -> None:
    """Return once `address` (host:port or unix:path) is SERVING. why_exited() names the reason its process is
    gone (None while it runs): then, or after timeout seconds, raise NotServing."""
    deadline = time.monotonic() + timeout
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            reason = why_exited()
            if reason is not None:
                raise NotServing(reason)
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(POLL_INTERVAL_S)
    raise NotServing(f"{address} did not become healthy in {timeout:.0f}s")
