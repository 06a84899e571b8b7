"""`python -m gpu_worker.parallel.follower`: a tensor-parallel rank other than 0, started by rank 0 (group.py). It
runs every Init, Step and adapter load rank 0 forwards on its own shard and answers nobody: rank 0 answers the
scheduler."""
from __future__ import annotations

import argparse
import logging
import sys

from protos import worker_pb2


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.parallel.follower", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="the group's rendezvous, tcp://HOST:PORT")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--parent-pid", type=int, required=True, help="rank 0: exit when it dies")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker rank {args.rank} %(levelname)s %(message)s")
    from gpu_worker.parallel.group import INIT, LOAD_ADAPTER, TensorParallel, read_message
    from gpu_worker.process import exit_with_parent
    from gpu_worker.worker import Worker

    exit_with_parent(args.parent_pid)
    worker = Worker(TensorParallel.join(args.rank, args.size, args.init_method, args.device))
    while (message := read_message(sys.stdin.buffer)) is not None:
        kind, payload = message
        if kind == INIT:
            worker.init(worker_pb2.InitRequest.FromString(payload))
        elif kind == LOAD_ADAPTER:   # rank 0 read it first: what it accepted, this rank reads too
            worker.load_adapter(worker_pb2.LoadAdapterRequest.FromString(payload))
        else:
            worker.step(worker_pb2.StepRequest.FromString(payload))


if __name__ == "__main__":
    main()
