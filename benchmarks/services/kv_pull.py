"""`ferry bench kv-pull`: a cached prefix pulled from another scheduler against recomputing it. Two schedulers
(`python -m scheduler`, no router, no Redis) serve the model; each round scheduler A computes a fresh random
prompt of --prompt-len tokens (one token out), then scheduler B serves the same prompt told to pull its prefix
from A (ScheduleRequest.kv_source), and another fresh prompt of the same length that it must compute whole.
Reports each one's time to first token (median over --rounds), their ratio, and the pull's bytes per second from
B's counters. Both schedulers get every core: only one computes at a time. With --tensor-parallel-size N each
scheduler's worker is a group of N ranks, and a block travels as every rank's share."""
from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import time

import grpc
import torch
from transformers import AutoConfig

from base.health import wait_until_serving
from benchmarks.common.cli_args import add_model_args, bench_parser, concrete_dtype, machine, model_dir, report
from protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_scheduler(directory: str, dtype: str, name: str, tensor_parallel_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "scheduler", "--port", str(port), "--scheduler-id", name,
                                "--model", directory, "--dtype", dtype, "--max-model-len", "4096",
                                "--tensor-parallel-size", str(tensor_parallel_size)],
                               env={**os.environ, "FERRY_LOG_LEVEL": "WARNING"})
    address = f"127.0.0.1:{port}"
    wait_until_serving(address, lambda: None if process.poll() is None else "the scheduler exited", 300)
    return process, address


def time_to_first_token(stub, prompt: list[int], request_id: str,
                        kv_source: scheduler_pb2.KvSource | None = None) -> float:
    """Seconds from submitting the request on a fresh Connect stream to its first tokens."""
    outgoing: queue.Queue = queue.Queue()
    request = scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=prompt, kv_source=kv_source,
                                            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0))
    started = time.perf_counter()
    outgoing.put(scheduler_pb2.ConnectRequest(submit=scheduler_pb2.SubmitRequest(request=request)))
    responses = stub.Connect(iter(outgoing.get, None), timeout=300)
    for message in responses:
        if any(event.HasField("output") for event in message.events):
            seconds = time.perf_counter() - started
            break
    outgoing.put(None)
    responses.cancel()
    return seconds


def measure(directory: str, dtype: str, prompt_len: int = 2048, rounds: int = 3, tensor_parallel_size: int = 1
            ) -> dict:
    vocab_size = AutoConfig.from_pretrained(directory).vocab_size
    generator = torch.Generator().manual_seed(0)
    fresh = lambda: torch.randint(10, vocab_size - 10, (prompt_len,), generator=generator).tolist()  # noqa: E731
    holder, holder_address = start_scheduler(directory, dtype, "holder", tensor_parallel_size)
    puller, puller_address = start_scheduler(directory, dtype, "puller", tensor_parallel_size)
    try:
        a, b = (scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(addr, options=[
            ("grpc.max_receive_message_length", 1 << 28)])) for addr in (holder_address, puller_address))
        time_to_first_token(b, fresh()[:64], "warm-up")
        blocks = (prompt_len - 1) // 16
        pulled, recomputed, computed_by_holder = [], [], []
        for round_index in range(rounds):
            prompt = fresh()
            computed_by_holder.append(time_to_first_token(a, prompt, f"hold-{round_index}"))
            source = scheduler_pb2.KvSource(scheduler_id="holder", address=holder_address, num_blocks=blocks)
            pulled.append(time_to_first_token(b, prompt, f"pull-{round_index}", source))
            recomputed.append(time_to_first_token(b, fresh(), f"compute-{round_index}"))
            print(f"[bench] round {round_index}: pulled {pulled[-1]:.3f} s, recomputed {recomputed[-1]:.3f} s",
                  file=sys.stderr)
        stats = b.Stats(scheduler_pb2.StatsRequest())
    finally:
        for process in (holder, puller):
            process.terminate()
            process.wait(30)
    ttft_pulled, ttft_recomputed = statistics.median(pulled), statistics.median(recomputed)
    return {"machine": machine(), "dtype": dtype, "prompt_len": prompt_len, "rounds": rounds,
            "tensor_parallel_size": tensor_parallel_size,
            "ttft_pulled_s": round(ttft_pulled, 4), "ttft_recomputed_s": round(ttft_recomputed, 4),
            "ttft_holder_computing_s": round(statistics.median(computed_by_holder), 4),
            "recomputed_over_pulled": round(ttft_recomputed / ttft_pulled, 2),
            "pulled_blocks": stats.kv_pulled_blocks, "pulled_bytes": stats.kv_pulled_bytes,
            "pulled_mib": round(stats.kv_pulled_bytes / (1 << 20), 1),
            "pull_seconds": round(stats.kv_pull_seconds, 4),
            "pull_mib_per_s": round(stats.kv_pulled_bytes / (1 << 20) / stats.kv_pull_seconds, 1),
            "pull_failures": stats.kv_pull_failures}


def main(argv: list[str]) -> int:
    parser = bench_parser("kv-pull", __doc__, json_output=True)
    add_model_args(parser)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks in each scheduler's worker group")
    args = parser.parse_args(argv)
    report(args, measure(model_dir(args), concrete_dtype(args.dtype), args.prompt_len, args.rounds,
                         args.tensor_parallel_size))
    return 0
