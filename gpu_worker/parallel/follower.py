"""`python -m gpu_worker.parallel.follower`: a tensor-parallel rank other than 0, started by rank 0 (group.py). It
runs every Init, Step and adapter load rank 0 forwards on its own shard and answers nobody: rank 0 answers the
scheduler. Beside the steps it answers rank 0's side requests: its share of KV blocks out and in (KV transfer
between schedulers), on a thread of its own, as rank 0 serves them beside its steps (gpu_worker/process.py says
why that is safe)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

import numpy

from protos import common_pb2, worker_pb2


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.parallel.follower", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="the group's rendezvous, tcp://HOST:PORT")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--parent-pid", type=int, required=True, help="rank 0: exit when it dies")
    parser.add_argument("--side-requests", type=int, required=True, help="the side pipe's read end (a descriptor)")
    parser.add_argument("--side-answers", type=int, required=True, help="its answers' write end (a descriptor)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker rank {args.rank} %(levelname)s %(message)s")
    from gpu_worker.parallel.group import INIT, LOAD_ADAPTER, TensorParallel, read_message
    from gpu_worker.process import exit_with_parent
    from gpu_worker.worker import Worker

    exit_with_parent(args.parent_pid)
    worker = Worker(TensorParallel.join(args.rank, args.size, args.init_method, args.device))
    threading.Thread(target=answer_side_requests, args=(worker, args.side_requests, args.side_answers), daemon=True,
                     name="side-requests").start()
    while (message := read_message(sys.stdin.buffer)) is not None:
        kind, payload = message
        if kind == INIT:
            worker.init(worker_pb2.InitRequest.FromString(payload))
        elif kind == LOAD_ADAPTER:   # rank 0 read it first: what it accepted, this rank reads too
            worker.load_adapter(common_pb2.LoraAdapterRequest.FromString(payload))
        else:
            worker.step(worker_pb2.StepRequest.FromString(payload))


def answer_side_requests(worker, requests_fd: int, answers_fd: int) -> None:
    """Rank 0's side requests, answered in order until it closes the pipe."""
    from gpu_worker.parallel.group import read_message, write_message

    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(answers_fd, "wb") as answers:
        while (message := read_message(requests)) is not None:
            write_message(answers, *answer(worker, *message))


def answer(worker, kind: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """(ANSWER, the bytes asked for) or (REFUSED, why)."""
    from gpu_worker.parallel.group import ANSWER, READ_BLOCKS, REFUSED

    try:
        if worker.runner is None:
            raise ValueError("the worker has no model yet")
        pool = worker.runner.pool
        if kind == READ_BLOCKS:
            return ANSWER, read_share(pool, worker_pb2.ReadBlocksRequest.FromString(payload))
        write_share(pool, worker_pb2.WriteBlocksRequest.FromString(payload))
        return ANSWER, b""
    except Exception as e:   # any failure is rank 0's to report: this thread must answer, or rank 0 waits forever
        return REFUSED, f"tensor-parallel rank: {e}".encode()


def read_share(pool, request: worker_pb2.ReadBlocksRequest) -> bytes:
    """This rank's share of the blocks: the bytes, or b"" once written into the chunk file at its offset."""
    raw = pool.read_raw(list(request.block_ids))
    if not request.shm_path:
        return raw.tobytes()
    with open(request.shm_path, "r+b") as file:   # rank 0 made it, with its own share
        file.seek(request.offset)
        raw.tofile(file)
    return b""


def write_share(pool, request: worker_pb2.WriteBlocksRequest) -> None:
    """This rank's share into the blocks: given, or from the chunk file at its offset (rank 0 removes the file)."""
    if request.shm_path:
        count = len(request.block_ids) * pool.bytes_per_block
        raw = numpy.fromfile(request.shm_path, dtype=numpy.uint8, count=count, offset=request.offset)
    else:
        raw = numpy.frombuffer(bytearray(request.data), dtype=numpy.uint8)
    pool.write_raw(list(request.block_ids), raw)


if __name__ == "__main__":
    main()
