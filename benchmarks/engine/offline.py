"""`ferry bench offline`: offline throughput of Ferry's in-process Engine in its modes (continuous, static batching,
contiguous KV, no prefix cache, eager) and of transformers `generate` (static left-padded batches), on the same
greedy requests: output tokens over the wall time from the first request added to the last finished, after a
warm-up; for the engine also its steps, forward time, preemptions and the most sequences one step ran."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from benchmarks.common.cli_args import (
    add_workload_args,
    bench_parser,
    concrete_dtype,
    load_requests,
    machine,
    model_dir,
    report,
)
from benchmarks.common.workloads import BenchRequest
from ferry import Engine, EngineConfig, SamplingParams

MODES = {
    "continuous": {},
    "static": {"batching": "static"},
    "contiguous": {"kv_layout": "contiguous", "max_model_len": 2048},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "eager": {"enforce_eager": True},
    "ngram": {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1024}'},
}


@dataclass
class OfflineResult:
    mode: str
    seconds: float
    output_tokens: int
    num_requests: int
    steps: int = 0
    forward_seconds: float = 0.0
    python_overhead_at_batch_64: float | None = None   # share of step time outside the forward and sampling
    num_preemptions: int = 0
    peak_running: int = 0     # the most sequences one step ran: what the KV pool held at once
    worker_idle_seconds: float = 0.0   # the worker's waits between steps (for the scheduler, the step message)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        return {**self.__dict__, "output_tokens_per_s": round(self.output_tokens_per_s, 2),
                "requests_per_s": round(self.num_requests / self.seconds, 3)}


def ferry_config(model: str, dtype: str, mode: str, max_num_seqs: int, kv_cache_memory: int,
                 max_num_batched_tokens: int = 0) -> EngineConfig:
    return EngineConfig(model=model, dtype=dtype, device="auto", max_num_seqs=max_num_seqs,
                        kv_cache_memory=kv_cache_memory, max_num_batched_tokens=max_num_batched_tokens, **MODES[mode])


def run_ferry(config: EngineConfig, mode: str, requests: list[BenchRequest], progress: bool = True) -> OfflineResult:
    engine = Engine(config)
    warm_up(engine)
    for i, r in enumerate(requests):
        engine.add_request(f"b{i}", r.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    total = sum(r.max_tokens for r in requests)
    bar = tqdm(total=total, desc=f"ferry {mode}", unit="tok", disable=not progress, leave=False)
    output_tokens = steps = peak_running = 0
    forward = idle = big_batch_wall = big_batch_forward = 0.0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        batch = len(engine.scheduler.running)
        peak_running = max(peak_running, batch)
        step_started = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - step_started
        new = sum(len(o.new_token_ids) for o in outputs)
        output_tokens += new
        steps += 1
        forward += engine.last_step_seconds
        idle += engine.last_idle_seconds
        if batch >= 56 and all(len(o.new_token_ids) == 1 for o in outputs):
            big_batch_wall += wall
            big_batch_forward += engine.last_step_seconds
        bar.update(new)
    seconds = time.perf_counter() - started
    bar.close()
    overhead = 1 - big_batch_forward / big_batch_wall if big_batch_wall else None
    return OfflineResult(mode, seconds, output_tokens, len(requests), steps, forward, overhead,
                         engine.stats().num_preemptions, peak_running, idle)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(engine: Engine) -> None:
    engine.generate([[11, 12, 13, 14]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def run_transformers(model_dir: str, dtype: str, requests: list[BenchRequest], batch_size: int = 16,
                     progress: bool = True, device: str = "auto") -> OfflineResult:
    """Static, left-padded batches of batch_size: each batch runs until its longest request is done. device "auto":
    the GPU where there is one, as the engine's own "auto"."""
    from transformers import AutoModelForCausalLM

    from gpu_worker.worker import resolve_device

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    target = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(target).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    started = time.perf_counter()
    for batch in tqdm(batches, desc="transformers", disable=not progress, leave=False):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch],
                           device=target)
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch],
                            device=target)
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
    synchronize(target)
    seconds = time.perf_counter() - started
    return OfflineResult("transformers", seconds, sum(r.max_tokens for r in requests), len(requests))


def main(argv: list[str]) -> int:
    parser = bench_parser("offline", __doc__)
    add_workload_args(parser)
    parser.add_argument("--modes", default="continuous,hf",
                        help="comma list of continuous, static, contiguous, no-prefix-cache, eager (no CUDA "
                             "graphs), ngram (prompt-lookup speculation at every batch size), hf")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0,
                        help="tokens a step computes at most (0: the device's default)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    directory = model_dir(args)
    requests = load_requests(args, directory)
    progress = sys.stderr.isatty()
    dtype = concrete_dtype(args.dtype)   # transformers runs in the dtype the engine computes in
    results = {}
    for mode in args.modes.split(","):
        if mode == "hf":
            results[mode] = run_transformers(directory, dtype, requests, args.hf_batch_size, progress).as_dict()
        else:
            config = ferry_config(directory, dtype, mode, args.max_num_seqs, args.kv_cache_memory,
                                  args.max_num_batched_tokens)
            results[mode] = run_ferry(config, mode, requests, progress).as_dict()
        print(f"[bench] {mode}: {results[mode]['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)
    ratios = {f"{m}/hf": round(r["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"], 3)
              for m, r in results.items() if m != "hf" and "hf" in results}
    if "continuous" in results and "static" in results:
        ratios["continuous/static"] = round(results["continuous"]["output_tokens_per_s"]
                                            / results["static"]["output_tokens_per_s"], 3)
    report(args, {"workload": str(args.workload_file or args.workload), "num_requests": len(requests),
                  "dtype": dtype, "machine": machine(), "results": results, "ratios": ratios})
    return 0
