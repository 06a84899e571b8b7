"""A tensor-parallel group: its ranks' collectives (gloo on CPUs, NCCL on GPUs), and rank 0's followers.

Rank 0 is the worker its scheduler talks to. It starts ranks 1..N-1 as processes of their own (follower.py) and
forwards them every Init and Step it is given, in order, down each follower's standard input: every rank then runs
the same step on its shard, meeting the others at the collectives. Only rank 0 answers the scheduler.

A follower that dies takes rank 0 down with it (the watch thread) where rank 0 is a worker process, and rank 0's
scheduler then restarts the whole group as it restarts any worker (in an in-process Engine the next step raises
instead); a follower whose rank 0 died reads the end of its input and exits."""
from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
import torch.distributed as dist

from protos import worker_pb2

log = logging.getLogger(__name__)
INIT, STEP, LOAD_ADAPTER = b"I", b"S", b"L"            # down a follower's standard input, in step order
READ_BLOCKS, WRITE_BLOCKS = b"R", b"W"                 # down its side pipe, beside the steps
ANSWER, REFUSED = b"A", b"E"                           # up its side pipe: the answer, or why there is none
HEADER = struct.Struct("<cI")   # message kind, payload length


@dataclass
class TensorParallel:
    """This rank's place in the group and the group's collectives. collective_seconds: time spent in them so
    far (on a GPU, the time to enqueue them)."""
    rank: int
    size: int
    device: torch.device
    collective_seconds: float = 0.0

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device_type: str) -> TensorParallel:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                                world_size=size)
        return cls(rank, size, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of their partial x (a row-parallel linear's output), in place."""
        started = time.perf_counter()
        dist.all_reduce(x)
        self.collective_seconds += time.perf_counter() - started
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's slice of the vocabulary [T, V / N] -> the whole logits [T, V] on every rank."""
        started = time.perf_counter()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        self.collective_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def same_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens on every rank: each rank samples the same logits with the same generators, but
        a rank that drew differently would corrupt its sequences silently; this way they cannot diverge."""
        if not tokens:
            return tokens
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        dist.broadcast(ids, src=0)
        return ids.tolist()

    def minimum(self, value: int) -> int:
        x = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return int(x.item())

    def gather_ints(self, value: int) -> list[int]:
        x = torch.tensor([value], dtype=torch.long, device=self.device)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return [int(p.item()) for p in parts]

    def shard(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` rows split evenly (the last rank's may be short: vocabularies)."""
        per_rank = -(-total // self.size)
        return min(total, self.rank * per_rank), min(total, (self.rank + 1) * per_rank)


@dataclass
class SidePipes:
    """Rank 0's ends of a follower's second pair of pipes: for what rank 0 asks it beside the steps (KV blocks out
    and in), which must not wait behind the steps queued on its standard input, and the follower's answers."""
    requests: BinaryIO
    answers: BinaryIO

    @classmethod
    def open(cls) -> tuple[SidePipes, tuple[int, int]]:
        """Rank 0's ends, and the follower's (the requests' read end, the answers' write end) to hand it."""
        request_read, request_write = os.pipe()
        answer_read, answer_write = os.pipe()
        return cls(os.fdopen(request_write, "wb"), os.fdopen(answer_read, "rb")), (request_read, answer_write)


@dataclass
class Followers:
    """Rank 0's ranks 1..N-1: their processes and the pipes rank 0 forwards its requests down."""
    group: TensorParallel
    processes: list[subprocess.Popen] = field(default_factory=list)
    side_pipes: list[SidePipes] = field(default_factory=list)
    side_lock: threading.Lock = field(default_factory=threading.Lock)   # one side request at a time
    stopped: threading.Event = field(default_factory=threading.Event)
    exit_with_group: bool = False   # a follower's death ends this process
    forward_seconds: float = 0.0    # spent handing requests down the pipes (what "rank 0 forwards" costs)
    threads_before: int = 0         # this process's math threads before the ranks split them

    @classmethod
    def start(cls, size: int, device_type: str, exit_with_group: bool) -> Followers:
        """Start ranks 1..size-1 and form the group with them (rank 0 is this process). On a CPU the ranks share
        this worker's threads. A process has one group at a time: an earlier one (an in-process Engine's) ends."""
        global current
        if current is not None:
            current.stop()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads_before = torch.get_num_threads()
        if device_type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        side_pipes, processes = [], []
        for rank in range(1, size):
            pipes, ends = SidePipes.open()
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "gpu_worker.parallel.follower", "--rank", str(rank), "--size", str(size),
                 "--init-method", init_method, "--device", device_type, "--parent-pid", str(os.getpid()),
                 "--side-requests", str(ends[0]), "--side-answers", str(ends[1])],
                stdin=subprocess.PIPE, env=env, pass_fds=ends))
            side_pipes.append(pipes)
            for end in ends:
                os.close(end)
        followers = cls(TensorParallel.join(0, size, init_method, device_type), processes, side_pipes,
                        exit_with_group=exit_with_group, threads_before=threads_before)
        threading.Thread(target=followers.watch, daemon=True, name="tp-followers").start()
        log.info("tensor parallel: %d ranks (%s)", size, dist.get_backend())
        current = followers
        return followers

    def stop(self) -> None:
        """End the followers (the end of their input) and this process's part in the group."""
        self.stopped.set()
        for process, pipes in zip(self.processes, self.side_pipes):
            process.stdin.close()
            pipes.requests.close()
        for process, pipes in zip(self.processes, self.side_pipes):
            process.wait()
            pipes.answers.close()
        dist.destroy_process_group()
        torch.set_num_threads(self.threads_before)

    def send(self, kind: bytes, message) -> None:
        started = time.perf_counter()
        payload = message.SerializeToString()
        try:
            for process in self.processes:
                write_message(process.stdin, kind, payload)
        except BrokenPipeError:
            raise RuntimeError("a tensor-parallel rank has exited: the group cannot step") from None
        self.forward_seconds += time.perf_counter() - started

    def read_blocks(self, block_ids: list[int], shm_path: str = "", offsets: list[int] = ()) -> list[bytes]:
        """Each follower's share of the KV blocks (its pool's KVPool.read_raw), in rank order; where shm_path is
        given, each writes its share into that file at its offset instead (b"" answered)."""
        return self.ask([(READ_BLOCKS, worker_pb2.ReadBlocksRequest(block_ids=block_ids, shm_path=shm_path,
                                                                    offset=offset))
                         for offset in offsets or [0] * len(self.side_pipes)])

    def write_blocks(self, block_ids: list[int], shares: list[bytes] = (), shm_path: str = "",
                     offsets: list[int] = ()) -> None:
        """Each follower's share (read_blocks's, of another group) into its pool's blocks, in rank order: given, or
        in the file shm_path at its offset (the caller removes the file)."""
        if shm_path:
            requests = [worker_pb2.WriteBlocksRequest(block_ids=block_ids, shm_path=shm_path, offset=offset)
                        for offset in offsets]
        else:
            requests = [worker_pb2.WriteBlocksRequest(block_ids=block_ids, data=share) for share in shares]
        self.ask([(WRITE_BLOCKS, request) for request in requests])

    def ask(self, requests: list[tuple[bytes, object]]) -> list[bytes]:
        """Each follower's answer to its request over the side pipes; ValueError where one refused or has exited."""
        with self.side_lock:
            try:
                for pipes, (kind, message) in zip(self.side_pipes, requests):
                    write_message(pipes.requests, kind, message.SerializeToString())
                answers = [read_message(pipes.answers) for pipes in self.side_pipes]
            except (BrokenPipeError, ValueError):   # ValueError: stop() closed the pipes meanwhile
                answers = [None]
        if any(answer is None for answer in answers):
            raise ValueError("a tensor-parallel rank has exited")
        refusals = [payload.decode() for kind, payload in answers if kind == REFUSED]
        if refusals:
            raise ValueError(refusals[0])
        return [payload for _, payload in answers]

    def watch(self) -> None:
        """A follower that exits leaves the group unable to step: end rank 0 too, so that the scheduler
        restarts the whole group."""
        while not self.stopped.wait(0.2):
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None and not self.stopped.is_set():
                    log.error("tensor parallel rank %d exited (code %s): the group is broken", rank,
                              process.returncode)
                    if self.exit_with_group:
                        os._exit(1)
                    return


current: Followers | None = None   # this process's group, where it is rank 0


def write_message(stream, kind: bytes, payload: bytes) -> None:
    stream.write(HEADER.pack(kind, len(payload)) + payload)
    stream.flush()


def read_message(stream) -> tuple[bytes, bytes] | None:
    """The next (kind, payload) on a pipe; None at its end (the other side is gone)."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    kind, length = HEADER.unpack(header)
    payload = stream.read(length)
    return (kind, payload) if len(payload) == length else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
