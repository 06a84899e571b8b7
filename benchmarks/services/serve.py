"""`ferry bench serve`: online load against a running server, Ferry's router (gRPC or its OpenAI HTTP API) or any
OpenAI-compatible one (vLLM's, SGLang's): requests sent at Poisson arrivals or all at once, at most
--max-concurrency in flight (guidellm's concurrent streams), every chunk streamed back and timed on arrival; reports
output tok/s (counted by the server's usage where it sends one), requests completed and failed, and TTFT, ITL, TPOT
and end-to-end latency mean, p50, p90 and p99 per request rate. `--synthetic 128:32` sends guidellm's synthetic shape
(random prompts of 128 tokens, 32 tokens out), the same token ids to every server; `--num-warmups N` sends N
requests first, uncounted."""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.common.cli_args import add_workload_args, bench_parser, load_requests, model_dir, report
from benchmarks.common.workloads import BenchRequest
from protos import common_pb2, router_pb2, router_pb2_grpc


@dataclass
class RequestTiming:
    sent: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def grpc_request(stub, request: BenchRequest, timing: RequestTiming) -> None:
    message = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=request.prompt_token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True))
    async for response in stub.Generate(message):
        if response.token_ids:
            timing.token_times.append(time.perf_counter())
            timing.output_tokens += len(response.token_ids)


async def http_request(client, request: BenchRequest, timing: RequestTiming, served_model: str = "") -> None:
    """One streamed completion; a chunk of text counts one token unless the server's usage says how many came."""
    body = {"model": served_model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    timing.token_times.append(time.perf_counter())
                    timing.output_tokens += 1
    if usage and usage.get("completion_tokens"):
        timing.output_tokens = usage["completion_tokens"]


def synthetic_requests(shape: str, num_prompts: int, vocab: int = 40000, seed: int = 0) -> list[BenchRequest]:
    """guidellm's synthetic data, "PROMPT:OUTPUT" tokens: random ids below `vocab` (the same for every server given
    one seed)."""
    prompt_tokens, output_tokens = (int(part) for part in shape.split(":"))
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(vocab // 40, vocab) for _ in range(prompt_tokens)], output_tokens)
            for _ in range(num_prompts)]


def warmup_requests(first: BenchRequest, count: int, vocab: int) -> list[BenchRequest]:
    """count requests of the first timed one's lengths with other ids, so that no timed prompt finds its prefix
    cached by the warm-up."""
    return synthetic_requests(f"{len(first.prompt_token_ids)}:{first.max_tokens}", count, vocab, seed=1)


async def run_load(requests: list[BenchRequest], target: str, request_rate: float, max_concurrency: int,
                   backend: str = "grpc", seed: int = 0, served_model: str = "") -> dict:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency)
    timings: list[RequestTiming] = []
    in_flight = peak = 0
    channel = grpc.aio.insecure_channel(target) if backend == "grpc" else None
    client = None
    if backend == "openai":
        import httpx
        client = httpx.AsyncClient(base_url=target if target.startswith("http") else f"http://{target}", timeout=None)
    stub = router_pb2_grpc.RouterStub(channel) if channel else None

    async def one(request: BenchRequest) -> None:
        nonlocal in_flight, peak
        async with limit:
            timing = RequestTiming(time.perf_counter())
            timings.append(timing)
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                if stub:
                    await grpc_request(stub, request, timing)
                else:
                    await http_request(client, request, timing, served_model)
            except Exception as error:  # noqa: BLE001 - a failed request is a result here
                timing.error = f"{type(error).__name__}: {error}"
            finally:
                in_flight -= 1

    started = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    if channel:
        await channel.close()
    if client:
        await client.aclose()
    return summarize(timings, duration, peak)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": sum(ordered) / len(ordered), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def summarize(timings: list[RequestTiming], duration: float, peak: int) -> dict:
    done = [t for t in timings if t.error is None and t.token_times]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    output_tokens = sum(t.output_tokens for t in done)
    return {
        "duration_s": duration, "completed": len(done), "failed": len(timings) - len(done),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "request_throughput": len(done) / duration, "output_tokens_per_s": output_tokens / duration,
        "peak_concurrency": peak, "ttft_s": percentiles([t.ttft for t in done]),
        "tpot_s": percentiles([t.tpot for t in done if t.tpot is not None]), "itl_s": percentiles(itl),
        "e2e_s": percentiles([t.e2e for t in done]), "ttft_samples_s": [round(t.ttft, 4) for t in done],
    }


def summary_line(result: dict) -> str:
    ms = lambda key, q: 1000 * result[key].get(q, float("nan"))  # noqa: E731
    return (f"{result['output_tokens_per_s']:.1f} output tok/s, {result['failed']} failed; TTFT p50 "
            f"{ms('ttft_s', 'p50'):.0f} / p90 {ms('ttft_s', 'p90'):.0f} ms, ITL p50 {ms('itl_s', 'p50'):.1f} / p90 "
            f"{ms('itl_s', 'p90'):.1f} ms")


def main(argv: list[str]) -> int:
    parser = bench_parser("serve", __doc__)
    add_workload_args(parser)
    parser.add_argument("--target", default="127.0.0.1:50051", help="router gRPC address, or HTTP base URL")
    parser.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    parser.add_argument("--request-rate", default="inf", help="req/s, comma list for a sweep; inf = all at once")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--synthetic", metavar="PROMPT:OUTPUT",
                        help="random prompts of PROMPT tokens asking OUTPUT tokens each, instead of --workload")
    parser.add_argument("--synthetic-vocab", type=int, default=40000, help="the synthetic prompts' ids lie below")
    parser.add_argument("--served-model", default="", help="the request's `model` (another server's model name)")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="requests of the first one's lengths (other ids) sent and awaited before the timed "
                             "runs, not counted (vLLM's bench flag)")
    parser.add_argument("--plot-dir", type=Path)
    args = parser.parse_args(argv)
    if args.synthetic:
        requests = synthetic_requests(args.synthetic, args.num_prompts, args.synthetic_vocab)
    else:
        requests = load_requests(args, model_dir(args) if args.workload == "chat" else None)
        requests = (requests * (args.num_prompts // len(requests) + 1))[:args.num_prompts]
    warmup = {}
    if args.num_warmups > 0:
        result = asyncio.run(run_load(warmup_requests(requests[0], args.num_warmups, args.synthetic_vocab),
                                      args.target, float("inf"), args.max_concurrency, args.backend,
                                      served_model=args.served_model))
        warmup = {"completed": result["completed"], "failed": result["failed"], "errors": result["errors"]}
        print(f"[bench] warm-up: {warmup['completed']} of {args.num_warmups} completed", file=sys.stderr)
    rates = [float(r) for r in args.request_rate.split(",")]
    runs = []
    for rate in rates:
        result = asyncio.run(run_load(requests, args.target, rate, args.max_concurrency, args.backend,
                                      served_model=args.served_model))
        print(f"[bench] rate {rate}: {summary_line(result)}", file=sys.stderr)
        runs.append((rate, result))
    if args.plot_dir:
        from benchmarks.common.plots import throughput_vs_rate, ttft_distribution
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        throughput_vs_rate(runs, args.plot_dir / "throughput_vs_rate.png")
        for rate, result in runs:
            ttft_distribution(result["ttft_samples_s"], args.plot_dir / f"ttft_rate_{rate:g}.png")
    report(args, {"backend": args.backend, "warmup": warmup,
                  "runs": [{"request_rate": str(r), **res} for r, res in runs]})
    return 0
