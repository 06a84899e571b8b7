"""The worker behind gRPC on a unix socket: one Step at a time, co-located with (and supervised by) its scheduler."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from base.grpc_options import GRPC_OPTIONS
from base.telemetry import TRACING_OFF, Tracing, links_to, setup_tracing
from gpu_worker.fault import crash_if_poisoned, poison_token
from protos import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
STEP_ORDER_WAIT_S = 5.0
OVERLAP_POLL_S = 0.0002     # with overlap on a GPU: how often a launched step's readiness is asked
OVERLAP_WAIT_CPU_S = 0.02   # with overlap on a CPU: how long a done step waits for the next before it answers


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, health_servicer: health.HealthServicer, tracing: Tracing = TRACING_OFF):
        from gpu_worker.worker import Worker

        self.worker = Worker(exit_with_group=True)
        self.health = health_servicer
        self.tracing = tracing
        # All model work on one thread, one call at a time: torch's OpenMP team belongs to the thread that starts
        # a parallel region, so steps hopping between gRPC's handler threads would each bring their own team
        # of math threads, spinning against each other on the same cores.
        self.compute = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.poison_token = poison_token()   # tests only (gpu_worker/fault.py)
        self.order = threading.Condition()
        self.last_submitted_step_id = 0
        self.unfinished: tuple | None = None   # with overlap: the launched step's (answer, span, request)

    def Init(self, request: worker_pb2.InitRequest, context: grpc.ServicerContext) -> worker_pb2.InitResponse:
        import torch

        try:
            response = self.compute.submit(self.worker.init, request).result()
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except torch.OutOfMemoryError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of device memory starting the worker "
                          f"(a smaller model, dtype or --max-num-batched-tokens, or a higher "
                          f"--gpu-memory-utilization): {e}")
        self.health.set("ferry.Worker", health_pb2.HealthCheckResponse.SERVING)
        return response

    def LoadAdapter(self, request: common_pb2.LoraAdapterRequest, context: grpc.ServicerContext
                    ) -> worker_pb2.LoadAdapterResponse:
        """On the compute thread, between two steps: a step reads the adapters loaded."""
        try:
            return self.compute.submit(self.worker.load_adapter, request).result()
        except (ValueError, OSError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Interrupt(self, request: worker_pb2.InterruptRequest, context: grpc.ServicerContext
                  ) -> worker_pb2.InterruptResponse:
        """On this handler's thread: the compute thread, in the step, looks between two layers."""
        self.worker.interrupt(request.step_id)
        return worker_pb2.InterruptResponse()

    def ReadBlocks(self, request: worker_pb2.ReadBlocksRequest, context: grpc.ServicerContext
                   ) -> worker_pb2.BlocksData:
        return self.beside_steps(self.worker.read_blocks, request, context)

    def WriteBlocks(self, request: worker_pb2.WriteBlocksRequest, context: grpc.ServicerContext
                    ) -> worker_pb2.BlocksData:
        return self.beside_steps(self.worker.write_blocks, request, context)

    @staticmethod
    def beside_steps(method, request, context: grpc.ServicerContext):
        """On this handler's thread, while a step may run: the blocks read are cached ones (computed by steps
        whose results are in, pinned, written by no step in flight) and the blocks written are reserved ones (no
        step reads them until they are adopted, after this returns). Queued behind the steps instead, a read
        waited for up to two of a busy holder's steps (seconds on a CPU), and pulls timed out."""
        try:
            return method(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def Step(self, request: worker_pb2.StepRequest, context: grpc.ServicerContext) -> worker_pb2.StepResult:
        crash_if_poisoned(request, self.poison_token)
        if self.worker.overlaps:
            done = futures.Future()
            self.in_step_order(request, lambda: self.compute.submit(self.overlapped_step, request, done))
            return done.result()
        step = self.traced_step if request.traceparents else self.worker.step
        return self.in_step_order(request, lambda: self.compute.submit(step, request)).result()

    def overlapped_step(self, request: worker_pb2.StepRequest, done: futures.Future) -> None:
        """On the compute thread: launch the step, which finishes the one launched before it; finish this one
        too unless the next step has come meanwhile (its launch will: the device goes from one to the next)."""
        span = self.tracing.tracer.start_span("worker.step", links=links_to(request.traceparents)) \
            if request.traceparents else None
        try:
            earlier = self.worker.launch(request)
        except Exception as e:   # the scheduler replaces the worker on a failed step: both fail
            self.settle_unfinished(lambda: None, error=e)
            settle(done, span, request, error=e)
            return
        if self.unfinished is not None:
            settle(*self.unfinished, result=earlier)
        self.unfinished = (done, span, request)
        if not self.next_step_came(request.step_id):
            self.settle_unfinished(self.worker.finish)

    def next_step_came(self, step_id: int) -> bool:
        """Wait for the step after step_id (True) or for step_id's tokens to be ready (False). On a CPU they are
        ready at once: there it waits OVERLAP_WAIT_CPU_S for the next step (worker_overlap on, tests)."""
        waited_enough = time.monotonic() + (OVERLAP_WAIT_CPU_S if self.worker.device_type == "cpu" else 0.0)
        with self.order:
            while self.last_submitted_step_id == step_id:
                if self.worker.launched_ready() and time.monotonic() >= waited_enough:
                    return False
                self.order.wait(timeout=OVERLAP_POLL_S)
        return True

    def settle_unfinished(self, finish, error: Exception | None = None) -> None:
        if self.unfinished is None:
            return
        (done, span, request), self.unfinished = self.unfinished, None
        try:
            result = finish() if error is None else None
        except Exception as e:
            error = e
        settle(done, span, request, result=result, error=error)

    def in_step_order(self, request: worker_pb2.StepRequest, submit):
        """Hand steps to the compute thread in the order they were sent: with async scheduling the next step
        arrives while one runs, on another handler thread that could otherwise overtake it. A step whose call was
        cancelled before it came holds the next one back STEP_ORDER_WAIT_S at most."""
        with self.order:
            if not self.order.wait_for(lambda: request.previous_step_id == self.last_submitted_step_id,
                                       timeout=STEP_ORDER_WAIT_S):
                log.warning("step %d: step %d never came", request.step_id, request.previous_step_id)
            future = submit()
            self.last_submitted_step_id = request.step_id
            self.order.notify_all()
        return future

    def traced_step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        """One step span, linked to every request span it served (a step serves many traces at once)."""
        with self.tracing.tracer.start_as_current_span("worker.step", links=links_to(request.traceparents)) as span:
            result = self.worker.step(request)
            span.set_attributes(step_attributes(request, result))
            return result


def step_attributes(request: worker_pb2.StepRequest, result: worker_pb2.StepResult) -> dict:
    return {"ferry.step_id": request.step_id, "ferry.num_new_seqs": len(request.new_seqs),
            "ferry.num_cached_seqs": len(request.cached_seqs),
            "ferry.num_scheduled_tokens": sum(s.num_scheduled_tokens for s in request.new_seqs)
            + sum(s.num_scheduled_tokens for s in request.cached_seqs),
            "ferry.num_sampled": len(result.sampled), "ferry.forward_seconds": result.forward_seconds}


def settle(done: futures.Future, span, request: worker_pb2.StepRequest,
           result: worker_pb2.StepResult | None = None, error: Exception | None = None) -> None:
    """An overlapped step's call answered (and its span, if traced, ended)."""
    if span is not None:
        if result is not None:
            span.set_attributes(step_attributes(request, result))
        span.end()
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def exit_with_parent(parent_pid: int) -> None:
    """The worker must never outlive its scheduler, even one killed with SIGKILL."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def serve(socket_path: str) -> None:
    health_servicer = health.HealthServicer()
    tracing = setup_tracing("ferry-worker")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(health_servicer, tracing), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"unix:{socket_path}")
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("ferry.Worker", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    log.info("worker serving on unix:%s", socket_path)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()
    tracing.shutdown()
