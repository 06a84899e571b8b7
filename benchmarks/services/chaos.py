"""`ferry bench chaos`: `ferry up` under steady streaming load while faults strike it one after another. Each
scenario is data: a fault to inject, how long it lasts, how it is lifted. Each runs the same way: load -> inject ->
hold -> lift -> wait until the stack serves again -> load a little longer -> check.

What a scenario is judged by, per request: done, failed before its first token, failed mid-stream, wrong (a
greedy answer that differs from the undisturbed one: a resumed stream must go on token for token), hung (past
its deadline); and per stack: seconds from the fault's end until every scheduler serves again and a request
goes through, KV back to 0 everywhere, the services' RSS. In every scenario here a live scheduler remains, so
nothing may fail (but the query of death itself, whose fate the row notes).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from base.cluster_auth import token_metadata
from benchmarks.common.cli_args import add_model_args, bench_parser, machine, model_dir, report
from benchmarks.services.chaos_faults import Fault, constrained_request, poison_token, scenarios
from benchmarks.services.served_stack import ServedStack
from ferry.launcher import free_port
from gpu_worker.fault import CRASH_ON_TOKEN_ENV
from protos import common_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

PROMPTS = [f"Chaos prompt {i}: the stack keeps serving whatever happens to its parts" for i in range(8)]


@dataclass
class Outcome:
    prompt: int
    token_ids: list[int] = field(default_factory=list)
    code: str = "OK"
    seconds: float = 0.0


@dataclass
class Load:
    """Clients streaming greedy requests back to back until stopped."""
    stack: ServedStack
    clients: int
    max_tokens: int
    deadline_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def request(self, prompt: int) -> Outcome:
        outcome, started = Outcome(prompt), time.monotonic()
        stub = router_pb2_grpc.RouterStub(self.stack.channel)
        sampling = common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            for message in stub.Generate(router_pb2.GenerateRequest(text=PROMPTS[prompt], sampling=sampling),
                                         timeout=self.deadline_s):
                outcome.token_ids += message.token_ids
        except grpc.RpcError as e:
            outcome.code = e.code().name
        outcome.seconds = time.monotonic() - started
        return outcome

    def client(self, index: int) -> None:
        turn = index
        while not self.stopping.is_set():
            self.outcomes.append(self.request(turn % len(PROMPTS)))
            turn += self.clients

    def run_during(self, body: Callable[[], float]) -> tuple[list[Outcome], float]:
        """Load while body() runs; returns the outcomes and what body returned."""
        with ThreadPoolExecutor(self.clients) as pool:
            for index in range(self.clients):
                pool.submit(self.client, index)
            try:
                result = body()
            finally:
                self.stopping.set()
        return self.outcomes, result


def serving(stack: ServedStack) -> bool:
    """Every scheduler ready and a request through the router."""
    for address in stack.schedulers:
        try:
            status = health_pb2_grpc.HealthStub(stack.channel_to(address)).Check(
                health_pb2.HealthCheckRequest(service="ferry.Scheduler"), timeout=2).status
        except grpc.RpcError:
            return False
        if status != health_pb2.HealthCheckResponse.SERVING:
            return False
    probe = Load(stack, 1, 2, 10.0).request(0)
    return probe.code == "OK"


def wait(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until predicate() held, None if it did not within timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.2)
    return None


def kv_idle(stack: ServedStack) -> bool:
    metadata = token_metadata(stack.cluster_token)
    for address in stack.schedulers:
        stats = scheduler_pb2_grpc.SchedulerStub(stack.channel_to(address)).Stats(
            scheduler_pb2.StatsRequest(), timeout=5, metadata=metadata)
        if stats.num_running or stats.num_waiting or stats.num_free_blocks != stats.num_blocks:
            return False
    return True


def rss_mb(pid: int) -> float:
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:
        return 0.0
    return int(fields["VmRSS"].split()[0]) / 1024


def run_scenario(stack: ServedStack, fault: Fault, reference: dict[int, list[int]], clients: int, max_tokens: int,
                 warm_s: float, tail_s: float, deadline_s: float) -> dict:
    stack.notes = {}
    rss_before = services_rss(stack)

    def strike() -> float:
        time.sleep(warm_s)
        fault.inject(stack)
        time.sleep(fault.hold_s)
        fault.lift(stack)
        recovered = wait(lambda: serving(stack), timeout=120)
        time.sleep(tail_s)
        return -1.0 if recovered is None else recovered

    outcomes, recover_s = Load(stack, clients, max_tokens, deadline_s).run_during(strike)
    row = judge(fault.name, outcomes, reference, recover_s, stack)
    rss_after = services_rss(stack)
    row["rss_growth"] = round(max(rss_after[n] / rss_before[n] for n in rss_after if rss_before.get(n)), 2)
    return row


def services_rss(stack: ServedStack) -> dict[str, float]:
    return {name: rss_mb(pid) for name, pid in stack.pids.items()}


def judge(name: str, outcomes: list[Outcome], reference: dict[int, list[int]], recover_s: float,
          stack: ServedStack) -> dict:
    done = [o for o in outcomes if o.code == "OK"]
    seconds = sorted(o.seconds for o in outcomes)
    return {
        "scenario": name, "requests": len(outcomes), "done": len(done),
        "failed_before_first_token": sum(o.code != "OK" and not o.token_ids for o in outcomes),
        "failed_mid_stream": sum(o.code != "OK" and bool(o.token_ids) for o in outcomes),
        "wrong": sum(o.token_ids != reference[o.prompt] for o in done),
        "hung": sum(o.code == "DEADLINE_EXCEEDED" for o in outcomes),
        "p99_s": round(seconds[int(0.99 * (len(seconds) - 1))], 2) if seconds else 0.0,
        "recover_s": round(recover_s, 1),
        "kv_back_to_0": wait(lambda: kv_idle(stack), timeout=30) is not None,
        "rss_mb": {name: round(rss) for name, rss in sorted(services_rss(stack).items())},
        **({"notes": stack.notes.copy()} if stack.notes else {}),
    }


def run(model: str, faults: list[Fault], clients: int = 8, max_tokens: int = 64, warm_s: float = 3.0,
        tail_s: float = 3.0, deadline_s: float = 120.0, up_flags: tuple[str, ...] = ()) -> list[dict]:
    """One `ferry up` (two schedulers) through every fault in turn; a row per fault."""
    poison, http_port = poison_token(model, PROMPTS), free_port()
    with ServedStack(["--model", model, "--num-schedulers", "2", "--policy", "round_robin",
                      "--http-port", str(http_port), *up_flags], env={CRASH_ON_TOKEN_ENV: str(poison)}) as stack:
        stack.poison_token, stack.http_port, stack.notes = poison, http_port, {}
        stack.wait_ready(2)
        reference = {i: Load(stack, 1, max_tokens, deadline_s).request(i).token_ids for i in range(len(PROMPTS))}
        for _ in range(2):   # round robin: both schedulers load xgrammar before any RSS is measured
            constrained_request(stack, common_pb2.StructuredOutput(regex="[a-z]+"), 2)
        return [run_scenario(stack, fault, reference, clients, max_tokens, warm_s, tail_s, deadline_s)
                for fault in faults]


def main(argv: list[str]) -> int:
    parser = bench_parser("chaos", __doc__, json_output=True)
    add_model_args(parser)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stop-seconds", type=float, default=10.0, help="how long a scheduler stays SIGSTOPped")
    parser.add_argument("--redis-down-seconds", type=float, default=30.0, help="how long Redis stays SIGSTOPped")
    parser.add_argument("--long-prompt-tokens", type=int, default=8000,
                        help="the length of the three prompts sent with their logprobs")
    parser.add_argument("--deadline-seconds", type=float, default=120.0,
                        help="a request not answered in this long counts as hung")
    parser.add_argument("--only", default="", help="comma list of scenario names to run (default: all)")
    # float32: each answer is the same whatever batch it shares, so a resumed stream can be checked token for token
    parser.set_defaults(dtype="float32")
    args = parser.parse_args(argv)
    faults = scenarios(args.stop_seconds, args.redis_down_seconds, long_prompt_tokens=args.long_prompt_tokens)
    if args.only:
        faults = [f for f in faults if f.name in args.only.split(",")]
    rows = run(model_dir(args), faults, args.clients, args.max_tokens, deadline_s=args.deadline_seconds,
               up_flags=("--dtype", args.dtype))
    report(args, {"machine": machine(), "clients": args.clients, "max_tokens": args.max_tokens, "scenarios": rows})
    return 0 if all(r["done"] == r["requests"] and not r["wrong"] for r in rows) else 1
