"""The worker runs steps in the order the scheduler sent them, even when the next one's call overtakes the one
before (async scheduling sends it while one runs, and gRPC hands each call to its own thread)."""
from __future__ import annotations

import threading
import time

from grpc_health.v1 import health

from gpu_worker import process
from gpu_worker.process import WorkerService
from protos import worker_pb2


def test_a_step_that_arrives_before_the_one_sent_ahead_of_it_waits_for_it() -> None:
    service = WorkerService(health.HealthServicer())
    order = []

    def arrive(step_id: int, previous: int) -> None:
        request = worker_pb2.StepRequest(step_id=step_id, previous_step_id=previous)
        service.in_step_order(request, lambda: order.append(step_id))

    later = threading.Thread(target=arrive, args=(8, 7))
    later.start()
    time.sleep(0.2)                 # step 8 is in, waiting
    assert order == []
    arrive(7, 0)                    # the first step this worker gets
    later.join(timeout=5)
    assert order == [7, 8]


def test_a_predecessor_that_never_comes_holds_the_next_step_back_only_for_a_while(monkeypatch) -> None:
    monkeypatch.setattr(process, "STEP_ORDER_WAIT_S", 0.2)
    service = WorkerService(health.HealthServicer())
    order = []
    service.in_step_order(worker_pb2.StepRequest(step_id=5, previous_step_id=4), lambda: order.append(5))
    assert order == [5]
