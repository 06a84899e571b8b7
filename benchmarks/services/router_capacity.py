"""`ferry bench router`: how many tokens a second one router relays, and what it costs per token.

A synthetic scheduler (benchmarks/services/synthetic_scheduler.py: the real Connect contract and Redis registration, a
token for each running request every `--step-interval`) stands in for an accelerator; the real router runs in its
own process (`python -m router`); clients in another process stream over gRPC, over the OpenAI HTTP API with SSE
(`sse`) and without streaming (`http`). Per run it reports the router's CPU seconds per token (utime + stime of
its process and its children, from /proc), tokens/s relayed, tokens per message, and the latency the router adds
to each token: the client's receive time minus the scheduler's send time, keyed by (request, token index), on the
same machine's clock. For `http` (one answer at the end) every token's latency is measured from the last one's send.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.common.cli_args import bench_parser, model_dir, report
from benchmarks.services.router_load_clients import PROMPT, BenchOptions, client_process
from ferry.launcher import free_port
from router.workers import children_of

# ---- the services -------------------------------------------------------------------------------------------

def process_tree_cpu_seconds(pid: int) -> float:
    """utime + stime of pid and, recursively, its live children (the router's --workers)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds + sum(process_tree_cpu_seconds(child) for child in children_of(pid))


@dataclass
class Services:
    processes: list[subprocess.Popen]
    router: subprocess.Popen
    scheduler: subprocess.Popen
    grpc_target: str
    base_url: str
    send_log_path: str

    def send_times(self) -> dict[str, list[float]]:
        """Stops the scheduler, which writes when it sent each token."""
        self.scheduler.terminate()
        self.scheduler.wait(30)
        with open(self.send_log_path) as f:
            return json.load(f)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def start_services(options: BenchOptions, workdir: str) -> Services:
    redis_port, scheduler_port, router_port, http_port = free_port(), free_port(), free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}"
    send_log = f"{workdir}/send_times.json"
    processes = [subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL)]
    scheduler = subprocess.Popen([sys.executable, "-m", "benchmarks", "synthetic-scheduler",
                                  "--port", str(scheduler_port), "--redis-url", redis_url,
                                  "--model-path", options.model_path,
                                  "--step-interval", str(options.step_interval), "--batch", str(options.batch),
                                  "--send-log", send_log], stdout=subprocess.DEVNULL)
    processes.append(scheduler)
    router_command = [sys.executable, "-m", "router", "--port", str(router_port), "--http-port", str(http_port),
                      "--redis-url", redis_url, "--log-level", "WARNING"]
    if options.workers > 1:
        router_command += ["--workers", str(options.workers)]
    router = subprocess.Popen(router_command, stdout=subprocess.DEVNULL)
    processes.append(router)
    services = Services(processes, router, scheduler, f"127.0.0.1:{router_port}", f"http://127.0.0.1:{http_port}",
                        send_log)
    try:
        wait_until_serving(services)
    except Exception:
        services.stop()
        raise
    return services


def wait_until_serving(services: Services, timeout: float = 60.0) -> None:
    """Until the router sees the scheduler and one request has gone through (the tokenizer is loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if services.router.poll() is not None:
            raise RuntimeError("the router exited")
        try:
            if httpx.get(f"{services.base_url}/health", timeout=1.0).status_code == 200:
                body = {"prompt": PROMPT, "max_tokens": 2}
                if httpx.post(f"{services.base_url}/v1/completions", json=body, timeout=10.0).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the router did not start serving")


# ---- one run and the report ---------------------------------------------------------------------------------

@dataclass
class RunResult:
    api: str
    clients: int
    tokens: int
    messages: int
    failed: int
    seconds: float
    router_cpu_s: float
    received: dict[str, list[float]]

    def summary(self, send_times: dict[str, list[float]], max_tokens: int) -> dict:
        added = added_latencies(self.api, self.received, send_times)
        return {"api": self.api, "clients": self.clients, "requests": len(self.received), "tokens": self.tokens,
                "messages": self.messages, "failed": self.failed,
                "incomplete_requests": sum(len(t) != max_tokens for t in self.received.values()),
                "seconds": round(self.seconds, 2),
                "tokens_per_s": round(self.tokens / self.seconds, 1),
                "tokens_per_message": round(self.tokens / max(1, self.messages), 2),
                "router_cpu_us_per_token": round(self.router_cpu_s / max(1, self.tokens) * 1e6, 1),
                "router_cpu_cores": round(self.router_cpu_s / self.seconds, 2),
                "added_latency_ms_p50": percentile_ms(added, 50), "added_latency_ms_p99": percentile_ms(added, 99),
                "latency_samples": len(added)}


def added_latencies(api: str, received: dict[str, list[float]], send_times: dict[str, list[float]]) -> list[float]:
    latencies = []
    for request_id, times in received.items():
        sent = send_times.get(request_id)
        if not sent:
            continue
        if api == "http":   # one answer at the end: from the last token's send
            sent = [sent[len(times) - 1]] * len(times) if len(times) <= len(sent) else []
        latencies += [r - s for r, s in zip(times, sent)]
    return latencies


def percentile_ms(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return round(values[0] * 1e3, 3) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3, 3)


def one_run(services: Services, api: str, num_clients: int, options: BenchOptions) -> RunResult:
    spawn = multiprocessing.get_context("spawn")
    ready, results = spawn.Event(), spawn.Queue()
    run_name = f"{api}-{num_clients}-{time.monotonic_ns()}"
    client = spawn.Process(target=client_process, args=(api, services.grpc_target, services.base_url, num_clients,
                                                         options, run_name, ready, results))
    client.start()
    ready.wait(60)   # the client process has imported what it needs; its start-up is not the router's
    cpu_before, started = process_tree_cpu_seconds(services.router.pid), time.monotonic()
    received, messages, failed = results.get(timeout=options.duration + 120)
    seconds = time.monotonic() - started
    cpu = process_tree_cpu_seconds(services.router.pid) - cpu_before
    client.join(30)
    return RunResult(api, num_clients, sum(len(t) for t in received.values()), messages, failed, seconds, cpu,
                     received)


def run(options: BenchOptions) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        services = start_services(options, workdir)
        try:
            runs = [one_run(services, api, n, options) for n in options.clients for api in options.apis]
            send_times = services.send_times()
        finally:
            services.stop()
    return {"step_interval_s": options.step_interval, "batch": options.batch, "max_tokens": options.max_tokens,
            "duration_s": options.duration, "workers": options.workers, "stream_interval": options.stream_interval,
            "cpu": cpu_name(), "runs": [r.summary(send_times, options.max_tokens) for r in runs]}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def plot_tokens_per_s(runs: list[dict], path: Path) -> None:
    """Tokens/s relayed against concurrent clients, one line per API."""
    from benchmarks.common.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for api in dict.fromkeys(r["api"] for r in runs):
        points = [(r["clients"], r["tokens_per_s"]) for r in runs if r["api"] == api]
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=api)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("tokens/s relayed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# flag, type, default, help
FLAGS = [
    ("--model", str, "", "tokenizer directory (default: SmolLM2-135M-Instruct's)"),
    ("--clients", str, "64", "concurrent streams, comma list for a sweep"),
    ("--apis", str, "grpc,sse,http", "comma list of grpc, sse (OpenAI streamed), http (OpenAI, not streamed)"),
    ("--duration", float, 5.0, "seconds of load per run"),
    ("--max-tokens", int, 128, "per request"),
    ("--step-interval", float, 0.01, "seconds per synthetic engine step"),
    ("--batch", int, 256, "most requests the synthetic scheduler runs at once"),
    ("--workers", int, 1, "router processes (python -m router --workers)"),
    ("--stream-interval", int, 0, "tokens per message clients ask for"),
]


def main(argv: list[str]) -> int:
    parser = bench_parser("router", __doc__, json_output=True)
    for flag, kind, default, text in FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--plot-dir", type=Path)
    args = parser.parse_args(argv)
    tokenizer_dir = args.model or model_dir(args)   # only its tokenizer is read: no config.json needed
    options = BenchOptions(tokenizer_dir, [int(c) for c in args.clients.split(",")], args.apis.split(","),
                           args.duration, args.max_tokens, args.step_interval, args.batch, args.workers,
                           args.stream_interval)
    result = run(options)
    for r in result["runs"]:
        print(f"[bench] {r['api']} x{r['clients']}: {r['tokens_per_s']:.0f} tok/s, "
              f"{r['router_cpu_us_per_token']} us router CPU/token, added p50 {r['added_latency_ms_p50']} ms "
              f"p99 {r['added_latency_ms_p99']} ms", file=sys.stderr)
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        plot_tokens_per_s(result["runs"], args.plot_dir / f"router_capacity_w{args.workers}.png")
    report(args, result)
    return 0
