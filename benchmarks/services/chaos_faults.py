"""The faults `ferry bench chaos` strikes a served stack with, as data: what to do, how long it lasts, how it is
lifted (benchmarks/services/chaos.py runs them)."""
from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.services.served_stack import ServedStack
from protos import common_pb2, router_pb2, router_pb2_grpc

VICTIM = "scheduler 0"


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[ServedStack], None]
    lift: Callable[[ServedStack], None] = lambda stack: None
    hold_s: float = 0.0                  # between inject and lift


def signal_victim(sig: int, name: str = VICTIM) -> Callable[[ServedStack], None]:
    return lambda stack: os.kill(stack.pids[name], sig)


def signal_worker(sig: int) -> Callable[[ServedStack], None]:
    def send(stack: ServedStack) -> None:
        scheduler = stack.pids[VICTIM]
        worker = int(Path(f"/proc/{scheduler}/task/{scheduler}/children").read_text().split()[0])
        os.kill(worker, sig)
    return send


def query_of_death(stack: ServedStack) -> None:
    """A request whose prompt kills every worker that takes it in (gpu_worker/fault.py), among the load."""
    prompt = router_pb2.TokenIds(ids=[10, 11, stack.poison_token])
    try:
        for _ in router_pb2_grpc.RouterStub(stack.channel).Generate(router_pb2.GenerateRequest(
                token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=120):
            pass
        stack.notes["query of death"] = "OK"
    except grpc.RpcError as e:
        stack.notes["query of death"] = e.code().name


def long_prompts_with_logprobs(num_tokens: int, count: int = 3) -> Callable[[ServedStack], None]:
    """Prompts of num_tokens with their prompt logprobs (what `echo` needs) and top-5 logprobs, among the load:
    outputs far bigger than a token's, which must neither break the stream they share nor slow it for long."""
    def send(stack: ServedStack) -> None:
        cycle = [t for t in range(100, 400) if t != stack.poison_token]
        ids = [cycle[i % len(cycle)] for i in range(num_tokens)]
        sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=5, logprobs=5)
        request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling=sampling)

        def one() -> str:
            try:
                list(router_pb2_grpc.RouterStub(stack.channel).Generate(request, timeout=300))
                return "OK"
            except grpc.RpcError as e:
                return e.code().name
        with ThreadPoolExecutor(count) as pool:
            stack.notes[f"{count} x {num_tokens}-token prompts with logprobs"] = list(pool.map(
                lambda _: one(), range(count)))
    return send


def grammar_bombs(num_properties: int, compiles: int = 3, fills: int = 1) -> Callable[[ServedStack], None]:
    """Structured outputs built to be slow, among the load: JSON schemas of num_properties optional properties
    (xgrammar's compile is cubic in their number; each schema distinct, so none is cached) that must fail at the
    compile time limit with INVALID_ARGUMENT, and a grammar of nested stars that compiles at once but fills each
    token's mask slowly, which may delay its own request only."""
    def schema(salt: int) -> str:
        properties = ", ".join(f'"p{salt}_{i}": {{"type": "integer"}}' for i in range(num_properties))
        return f'{{"type": "object", "properties": {{{properties}}}}}'

    def send(stack: ServedStack) -> None:
        bombs = [common_pb2.StructuredOutput(json_schema=schema(i)) for i in range(compiles)]
        stars = "root ::= " + "(" * 60 + "[a-z]*" + ")*" * 60
        bombs += [common_pb2.StructuredOutput(grammar=stars)] * fills
        with ThreadPoolExecutor(len(bombs)) as pool:
            codes = list(pool.map(lambda constraint: constrained_request(stack, constraint, 16), bombs))
        stack.notes[f"{compiles} compile bombs"] = codes[:compiles]
        stack.notes[f"{fills} slow-fill grammars"] = codes[compiles:]
    return send


def constrained_request(stack: ServedStack, constraint: common_pb2.StructuredOutput, max_tokens: int) -> str:
    """A request under the constraint: its status code's name."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_output=constraint)
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[10, 11, 12]), sampling=sampling)
    try:
        list(router_pb2_grpc.RouterStub(stack.channel).Generate(request, timeout=300))
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


@dataclass
class SlowClients:
    """HTTP connections that send their headers a byte at a time (slowloris); how many the router cut."""
    count: int
    sockets: list[socket.socket] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def open(self, stack: ServedStack) -> None:
        for _ in range(self.count):
            conn = socket.create_connection(("127.0.0.1", stack.http_port))
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            self.sockets.append(conn)
        threading.Thread(target=self.trickle, daemon=True).start()

    def trickle(self) -> None:
        while not self.stop.wait(0.5):
            for conn in self.sockets:
                try:
                    conn.sendall(b"X")
                except OSError:
                    pass

    def close(self, stack: ServedStack) -> None:
        self.stop.set()
        stack.notes["slow clients cut by the router"] = f"{sum(map(cut, self.sockets))} of {self.count}"
        for conn in self.sockets:
            conn.close()


def cut(conn: socket.socket) -> bool:
    """The router answered the connection or closed it (its header timeout), rather than still waiting on it."""
    conn.setblocking(False)
    try:
        conn.recv(1 << 16)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def scenarios(stop_s: float = 10.0, redis_down_s: float = 30.0, slow_s: float = 12.0,
              long_prompt_tokens: int = 8000, bomb_properties: int = 2000) -> list[Fault]:
    slow = SlowClients(64)
    return [Fault("kill worker", signal_worker(signal.SIGKILL)),
            Fault("query of death", query_of_death),
            Fault(f"slowloris: 64 clients, {slow_s:g} s", slow.open, slow.close, slow_s),
            Fault("long prompts with logprobs", long_prompts_with_logprobs(long_prompt_tokens)),
            Fault("grammar bombs", grammar_bombs(bomb_properties)),
            Fault("kill scheduler", signal_victim(signal.SIGKILL)),
            Fault(f"stop scheduler {stop_s:g} s", signal_victim(signal.SIGSTOP), signal_victim(signal.SIGCONT),
                  stop_s),
            Fault("kill redis", signal_victim(signal.SIGKILL, "redis-server")),
            Fault(f"redis down {redis_down_s:g} s", signal_victim(signal.SIGSTOP, "redis-server"),
                  signal_victim(signal.SIGCONT, "redis-server"), redis_down_s)]


def poison_token(model: str, prompts: list[str]) -> int:
    """A token id no load prompt holds: the query of death's."""
    from router.tokenizer import load_tokenizer

    used = {t for prompt in prompts for t in load_tokenizer(model).encode(prompt)}
    return next(t for t in range(100, 100_000) if t not in used)
