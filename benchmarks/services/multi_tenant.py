"""`ferry bench tenants`: what one tenant's flood costs another tenant's latency, under each scheduling policy.

Each scheduler count and policy gets a fresh `ferry up`; streamed /v1/completions requests over its HTTP API, the
tenant in the `x-ferry-tenant` header, the class in the body's `priority`. The loads:
  light   open loop: a short request sent every 1/rate seconds, on schedule, for the phase's duration
  flood   closed loop: N streams, each sending its next long request as soon as its previous one ends
The phases:
  light_alone      the light tenant alone (once per scheduler count, under fcfs)
  flood_alone      the flood tenant alone (idem)
  flood_and_light  both at once, tenants "flood" and "light" (under each policy)
  priority_mix     the flood's shape as tenant "batch" at priority 1, the light's as "interactive" at priority 0
                   (under each policy)
Measured: TTFT, from a request's send to its first chunk with text, per request (p50, p90 in ms); the flood's
output tok/s: the tokens received while it ran over the time it ran (a chunk with text is a token; a finished
request's usage.completion_tokens beyond its chunks, text held back and sent together, count at its last chunk;
requests cancelled when the phase ends count the chunks they got). Prompts are random token ids, different for
every request (no prefix cache hits), the same for a seed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from base.cluster_auth import token_metadata
from base.options import DefaultsHelpFormatter, add_arguments, from_args, option
from benchmarks.common.cli_args import add_model_args, bench_parser, machine, model_dir, report
from benchmarks.services.serve import percentiles
from benchmarks.services.served_stack import ServedStack
from ferry.launcher import free_port
from protos import scheduler_pb2, scheduler_pb2_grpc

DRAIN_TIMEOUT_S = 120.0


class RawDescriptionDefaultsFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """The module's docstring as written, every flag's default in its help."""


@dataclass
class TenantBenchOptions:
    """The loads' shapes and what runs them."""
    duration: float = option(30.0, "seconds each phase sends requests")
    light_rate: float = option(1.0, "light requests sent per second (open loop)")
    light_prompt_tokens: int = option(64, "prompt length of a light request")
    light_output_tokens: int = option(16, "output length of a light request (EOS ignored)")
    flood_streams: int = option(32, "concurrent streams of the flood, each one request after another")
    flood_prompt_tokens: int = option(512, "prompt length of a flood request")
    flood_output_tokens: int = option(128, "output length of a flood request (EOS ignored)")
    policies: str = option("fcfs,fair,priority", "comma list of --scheduling-policy values; fcfs passes no flag "
                                                 "and always runs (the loads alone, every ratio's baseline)")
    num_schedulers: str = option("1", "comma list of scheduler counts, a fresh `ferry up` for each")
    max_num_seqs: int = option(0, "sequences a scheduler runs at once; 0: the engine's default")
    kv_cache_memory: int = option(0, "KV cache bytes per scheduler; 0: the engine's default")
    max_num_batched_tokens: int = option(0, "tokens a step computes at most (a shorter step is a shorter wait for "
                                            "a newcomer); 0: the engine's default")
    seed: int = option(0, "seed of the prompts")


@dataclass(frozen=True)
class Load:
    """One tenant's requests: who sends them, at which priority, and their shape."""
    tenant: str
    prompt_tokens: int
    output_tokens: int
    priority: int | None = None     # None: the body has no priority field


@dataclass
class Answer:
    """One streamed request as the client saw it: when it was sent, when each token came, what went wrong."""
    sent: float
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent


@dataclass(frozen=True)
class Prompts:
    """Random token ids per (phase, tenant, request number): different for every request of a stack's phases, so no
    phase hits the prefix cache another filled, and the same for a seed (each policy's stack gets the same)."""
    seed: int
    vocab_size: int
    phase: str = ""

    def ids(self, load: Load, number: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{self.phase}:{load.tenant}:{number}")
        low, high = self.vocab_size // 8, self.vocab_size - self.vocab_size // 8   # clear of special tokens
        return [rng.randrange(low, high) for _ in range(load.prompt_tokens)]


def open_loop_times(rate: float, duration: float) -> list[float]:
    """Send offsets of an open loop: one every 1/rate seconds from 0, all before duration."""
    return [i / rate for i in range(math.ceil(duration * rate))]


def request_body(load: Load, prompt: list[int]) -> dict:
    body = {"model": "", "prompt": prompt, "max_tokens": load.output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if load.priority is not None:
        body["priority"] = load.priority
    return body


async def stream_request(client: httpx.AsyncClient, load: Load, prompt: list[int], answer: Answer) -> None:
    """One request, its tokens timed into answer; an HTTP error or an error event is the answer's error."""
    headers = {"x-ferry-tenant": load.tenant}
    async with client.stream("POST", "/v1/completions", json=request_body(load, prompt), headers=headers) as response:
        if response.status_code != 200:
            answer.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                read_chunk(json.loads(line[6:]), answer)


def read_chunk(chunk: dict, answer: Answer) -> None:
    now = time.perf_counter()
    if "error" in chunk:
        answer.error = str(chunk["error"])[:200]
    elif chunk.get("choices") and chunk["choices"][0].get("text"):
        answer.token_times.append(now)
    elif chunk.get("usage") and answer.token_times:   # tokens whose text came in an earlier chunk
        held_back = chunk["usage"]["completion_tokens"] - len(answer.token_times)
        answer.token_times += [answer.token_times[-1]] * max(0, held_back)


async def answer_one(client: httpx.AsyncClient, load: Load, prompt: list[int], answers: list[Answer]) -> None:
    answer = Answer(time.perf_counter())
    answers.append(answer)
    try:
        await stream_request(client, load, prompt, answer)
    except httpx.HTTPError as error:
        answer.error = f"{type(error).__name__}: {error}"
    if answer.error is None and not answer.token_times:
        answer.error = "no tokens"


async def open_loop(client: httpx.AsyncClient, load: Load, prompts: Prompts, rate: float, duration: float
                    ) -> list[Answer]:
    """Requests sent on schedule, whether or not earlier ones are answered; returns once all are answered."""
    answers: list[Answer] = []
    started, tasks = time.perf_counter(), []
    for number, offset in enumerate(open_loop_times(rate, duration)):
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(answer_one(client, load, prompts.ids(load, number), answers)))
    await asyncio.gather(*tasks)
    return answers


async def closed_loop_stream(client: httpx.AsyncClient, load: Load, prompts: Prompts, stream: int, streams: int,
                             answers: list[Answer]) -> None:
    """One stream of the flood: request after request until cancelled."""
    for number in range(stream, sys.maxsize, streams):
        await answer_one(client, load, prompts.ids(load, number), answers)


async def run_phase(base_url: str, prompts: Prompts, options: TenantBenchOptions, light: Load | None,
                    flood: Load | None) -> dict:
    """The flood (if any) runs for the duration, and on until the light load (if any) is answered."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        flood_answers: list[Answer] = []
        started = time.perf_counter()
        streams = [asyncio.create_task(closed_loop_stream(client, flood, prompts, s, options.flood_streams,
                                                          flood_answers))
                   for s in range(options.flood_streams if flood else 0)]
        light_answers = await open_loop(client, light, prompts, options.light_rate, options.duration) if light else []
        await asyncio.sleep(max(0.0, started + options.duration - time.perf_counter()))
        flood_seconds = time.perf_counter() - started
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    phase = {}
    if light:
        phase[light.tenant] = light_summary(light, light_answers)
    if flood:
        phase[flood.tenant] = flood_summary(flood, flood_answers, flood_seconds)
    return phase


def light_summary(load: Load, answers: list[Answer]) -> dict:
    done = [a for a in answers if a.error is None]
    return {"priority": load.priority, "sent": len(answers), "count": len(done), "errors": len(answers) - len(done),
            "error_samples": sorted({a.error for a in answers if a.error})[:3],
            "mean_output_tokens": round(sum(len(a.token_times) for a in done) / len(done), 2) if done else 0.0,
            "ttft_ms": ttft_ms(done)}


def flood_summary(load: Load, answers: list[Answer], seconds: float) -> dict:
    """Requests the phase's end cancelled are neither answered nor errors: their tokens count, and their TTFT if
    they had a first token (those still waiting for it are counted apart: the TTFT percentiles leave them out)."""
    ok = [a for a in answers if a.error is None]
    failed = [a for a in answers if a.error]
    tokens = sum(len(a.token_times) for a in ok)
    return {"priority": load.priority, "streams_seconds": round(seconds, 2),
            "count": sum(len(a.token_times) == load.output_tokens for a in ok),
            "waiting_at_end": sum(not a.token_times for a in ok), "errors": len(failed),
            "error_samples": sorted({a.error for a in failed})[:3], "output_tokens": tokens,
            "output_tok_s": round(tokens / seconds, 1), "ttft_ms": ttft_ms([a for a in ok if a.token_times])}


def ttft_ms(answers: list[Answer]) -> dict:
    spread = percentiles([a.ttft * 1e3 for a in answers])
    return {q: round(spread[q], 1) for q in ("p50", "p90")} if spread else {}


def phases_of(policy: str, options: TenantBenchOptions) -> dict[str, tuple[Load | None, Load | None]]:
    """Each phase's (light, flood) loads; the loads alone only under fcfs, since they do not depend on policy."""
    light = Load("light", options.light_prompt_tokens, options.light_output_tokens)
    flood = Load("flood", options.flood_prompt_tokens, options.flood_output_tokens)
    interactive = Load("interactive", light.prompt_tokens, light.output_tokens, priority=0)
    batch = Load("batch", flood.prompt_tokens, flood.output_tokens, priority=1)
    alone = {"light_alone": (light, None), "flood_alone": (None, flood)} if policy == "fcfs" else {}
    return {**alone, "flood_and_light": (light, flood), "priority_mix": (interactive, batch)}


def up_args(model: str, num_schedulers: int, policy: str, http_port: int, options: TenantBenchOptions,
            dtype: str, metrics_port: int) -> list[str]:
    flags = ["--model", model, "--dtype", dtype, "--num-schedulers", str(num_schedulers),
             "--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    if policy != "fcfs":   # the default; no flag, so the bench runs on servers without --scheduling-policy
        flags += ["--scheduling-policy", policy]
    if options.max_num_seqs:
        flags += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.kv_cache_memory:
        flags += ["--kv-cache-memory", str(options.kv_cache_memory)]
    if options.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    return flags


def served_run(model: str, num_schedulers: int, policy: str, options: TenantBenchOptions, dtype: str) -> dict:
    """One fresh `ferry up`: a warm-up request, then the policy's phases in turn."""
    http_port, metrics_port = free_port(), free_port()   # scheduler i answers /metrics on metrics_port + i
    base_url = f"http://127.0.0.1:{http_port}"
    metrics_urls = [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(num_schedulers)]
    prompts = Prompts(options.seed, vocab_size(model))
    with ServedStack(up_args(model, num_schedulers, policy, http_port, options, dtype, metrics_port)) as stack:
        stack.wait_ready(num_schedulers)
        asyncio.run(warm_up(base_url, prompts))
        phases = {}
        for name, (light, flood) in phases_of(policy, options).items():
            before, cut_before = queue_times(metrics_urls), interrupted_steps(stack)
            phases[name] = asyncio.run(run_phase(base_url, replace(prompts, phase=name), options, light, flood))
            phases[name]["drain_s"] = drain(stack)
            phases[name]["interrupted_steps"] = interrupted_steps(stack) - cut_before
            add_queue_times(phases[name], before, queue_times(metrics_urls))
            print(f"[bench] {num_schedulers} scheduler(s) {policy} {name}: {phases[name]}", file=sys.stderr,
                  flush=True)
    return {"num_schedulers": num_schedulers, "policy": policy, "phases": phases}


async def warm_up(base_url: str, prompts: Prompts) -> None:
    """A few short requests, so that no timed request pays for a cold start."""
    load = Load("warm-up", 8, 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=None) as client:
        answers: list[Answer] = []
        await asyncio.gather(*(answer_one(client, load, prompts.ids(load, n), answers) for n in range(4)))
    if any(a.error for a in answers):
        raise RuntimeError(f"the warm-up request failed: {answers[0].error}")


def scheduler_stats(stack: ServedStack) -> list[scheduler_pb2.StatsResponse]:
    metadata = token_metadata(stack.cluster_token)
    return [scheduler_pb2_grpc.SchedulerStub(stack.channel_to(address)).Stats(
        scheduler_pb2.StatsRequest(), timeout=5, metadata=metadata) for address in stack.schedulers]


def interrupted_steps(stack: ServedStack) -> int:
    """Steps the schedulers have had cut short so far, for a request that outranked their work."""
    return sum(s.num_interrupted_steps for s in scheduler_stats(stack))


def drain(stack: ServedStack) -> float:
    """Seconds until every scheduler has no request running or waiting (those the phase cancelled gone)."""
    started = time.monotonic()
    while time.monotonic() - started < DRAIN_TIMEOUT_S:
        if not any(s.num_running or s.num_waiting for s in scheduler_stats(stack)):
            return round(time.monotonic() - started, 2)
        time.sleep(0.1)
    raise RuntimeError(f"the schedulers still had requests {DRAIN_TIMEOUT_S:.0f}s after the phase")


def queue_times(metrics_urls: list[str]) -> dict[str, list[float]]:
    """Each tenant's [seconds, requests] of scheduler queue time so far (ferry:tenant_queue_time_seconds, from a
    request's arrival at its scheduler to the step that first computes it), summed over the schedulers."""
    totals: dict[str, list[float]] = {}
    for url in metrics_urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            if family.name != "ferry:tenant_queue_time_seconds":
                continue
            for sample in family.samples:
                kind = {"ferry:tenant_queue_time_seconds_sum": 0, "ferry:tenant_queue_time_seconds_count": 1}
                if sample.name in kind:
                    totals.setdefault(sample.labels["tenant"], [0.0, 0.0])[kind[sample.name]] += sample.value
    return totals


def add_queue_times(phase: dict, before: dict[str, list[float]], after: dict[str, list[float]]) -> None:
    """The mean scheduler queue time of each of the phase's tenants, in ms: what the policy decides (TTFT adds the
    steps in flight when a request arrives and its own)."""
    for tenant, entry in phase.items():
        if isinstance(entry, dict) and tenant in after:
            seconds, count = (a - b for a, b in zip(after[tenant], before.get(tenant, [0.0, 0.0])))
            entry["scheduler_queue_ms_mean"] = round(seconds / count * 1e3, 1) if count else None


def vocab_size(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


def p90(phase: dict, tenant: str) -> float | None:
    return phase.get(tenant, {}).get("ttft_ms", {}).get("p90")


def ratios(runs: list[dict]) -> dict:
    """Per scheduler count: light p90 TTFT flooded / alone (per policy), the flood's tok/s under fair / under fcfs,
    priority-0 p90 TTFT / priority-1 p90 TTFT (per policy)."""
    derived = {}
    for count in sorted({run["num_schedulers"] for run in runs}):
        by_policy = {run["policy"]: run["phases"] for run in runs if run["num_schedulers"] == count}
        alone = by_policy.get("fcfs", {}).get("light_alone", {})
        flood_tok_s = {policy: phases["flood_and_light"]["flood"]["output_tok_s"]
                       for policy, phases in by_policy.items()}
        derived[str(count)] = {
            "light_p90_flooded_over_alone": {policy: ratio(p90(phases["flood_and_light"], "light"),
                                                           p90(alone, "light"))
                                             for policy, phases in by_policy.items()},
            "flood_tok_s_fair_over_fcfs": ratio(flood_tok_s.get("fair"), flood_tok_s.get("fcfs")),
            "priority0_p90_over_priority1_p90": {policy: ratio(p90(phases["priority_mix"], "interactive"),
                                                               p90(phases["priority_mix"], "batch"))
                                                 for policy, phases in by_policy.items()},
        }
    return derived


def cpu_model() -> str:
    """lscpu's "Model name" (where the client and, on a CPU run, the model run)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def run(options: TenantBenchOptions, model: str, dtype: str) -> dict:
    counts = [int(n) for n in options.num_schedulers.split(",")]
    policies = options.policies.split(",")
    if "fcfs" not in policies:
        policies.insert(0, "fcfs")   # the loads alone, the baseline of every ratio
    runs = [served_run(model, count, policy, options, dtype) for count in counts for policy in policies]
    return {"model": model, "cpu_model": cpu_model(), "machine": machine(), "options": asdict(options),
            "runs": runs, "ratios": ratios(runs)}


def main(argv: list[str]) -> int:
    parser = bench_parser("tenants", __doc__, json_output=True)
    parser.formatter_class = RawDescriptionDefaultsFormatter
    add_model_args(parser)
    add_arguments(parser, TenantBenchOptions)
    args = parser.parse_args(argv)
    report(args, run(from_args(TenantBenchOptions, args), model_dir(args), args.dtype))
    return 0
