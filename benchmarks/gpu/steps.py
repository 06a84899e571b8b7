"""The steps of the GPU check (benchmarks/gpu/check.py), each a function of a Plan returning a JSON-able dict.

Each runs in its own process, so that one that crashes or hangs costs only itself and the device's memory is
whole again for the next. On a CPU the same steps run at tiny shapes (the plumbing test).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.random_models import save_random_llama
from benchmarks.common.workloads import BenchRequest

GiB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """What each step runs: the GPU sizes, or tiny ones that check the plumbing on a CPU."""
    device: str
    exact_shapes: tuple[str, ...]       # fp32 token-exact against transformers; bf16: the first divergence
    exact_prompts: int
    exact_tokens: int
    serve_shape: str
    bench_shape: str
    fixed_requests: int                 # the throughput target's workload: fixed prompt and output lengths
    fixed_prompt: int
    fixed_output: int
    hf_requests: int                    # transformers runs a subset: its batches of 16 all have the same shape
    tailed_requests: int                # long-tailed lengths: continuous vs static, paged vs contiguous
    tailed_max_output: int
    tailed_max_num_seqs: int
    kv_gib_for_layouts: float           # the pool paged and contiguous share
    roofline_batch: int
    roofline_prompt: int
    kernel_contexts: tuple[int, ...]
    lora_requests: int                  # multi-LoRA: requests in the batch, spread over 1, 4 and 16 adapters


GPU_PLAN = Plan(device="cuda", exact_shapes=("tiny", "smollm2-135m"), exact_prompts=8, exact_tokens=32,
                serve_shape="smollm2-135m", bench_shape="llama-3.2-1b", fixed_requests=256, fixed_prompt=512,
                fixed_output=256, hf_requests=32, tailed_requests=64, tailed_max_output=512, tailed_max_num_seqs=16,
                kv_gib_for_layouts=1.0, roofline_batch=64, roofline_prompt=512, kernel_contexts=(2048,),
                lora_requests=64)
SMOKE_PLAN = Plan(device="cpu", exact_shapes=("tiny",), exact_prompts=2, exact_tokens=4, serve_shape="tiny",
                  bench_shape="tiny", fixed_requests=4, fixed_prompt=16, fixed_output=4, hf_requests=2,
                  tailed_requests=6, tailed_max_output=12, tailed_max_num_seqs=2, kv_gib_for_layouts=0.001,
                  roofline_batch=2, roofline_prompt=8, kernel_contexts=(64,), lora_requests=4)


def model_dir(plan: Plan, work: Path, shape: str, dtype: torch.dtype, **overrides) -> Path:
    """A random model of `shape` saved once under work ("tiny": the tests' tiny Llama, larger weights so that
    greedy outputs vary)."""
    path = work / f"{shape}-{str(dtype).removeprefix('torch.')}{'-own-vocab' if overrides else ''}"
    if not (path / "config.json").is_file():
        save_random_llama(path, shape, dtype, plan.device, weight_std=0.15 if shape == "tiny" else 0.0, **overrides)
    return path


def environment(plan: Plan, work: Path) -> dict:
    import transformers
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {"device": props.name, "capability": f"{props.major}.{props.minor}",
                 "memory_gib": round(props.total_memory / GiB, 1), "multiprocessors": props.multi_processor_count,
                 "nvidia_smi": nvidia_smi()}
    return info


def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unavailable: {error}"


def cuda_tests(plan: Plan, work: Path) -> dict:
    """The tests that run only on a GPU (the kernels at real shapes, the worker's graphs and memory) and the
    sampler's, which compare the GPU with the CPU there. pytest's report goes to the step's log."""
    env = os.environ | {"TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                          "tests/unit/kernels/test_cuda_kernels.py", "tests/unit/gpu_worker/test_cuda_worker.py",
                          "tests/unit/gpu_worker/test_sampler.py", "tests/unit/gpu_worker/test_moe_grouped_mm.py"],
                         capture_output=True, text=True, env=env, timeout=400)
    print(run.stdout, run.stderr, file=sys.stderr)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    return {"passed": run.returncode in (0, 5), "summary": summary, "failures": failure_lines(run.stdout)}


def failure_lines(pytest_output: str, limit: int = 12) -> list[str]:
    return [line for line in pytest_output.splitlines() if line.startswith(("FAILED", "ERROR"))][:limit]


def exactness(plan: Plan, work: Path) -> dict:
    """Greedy continuations from Ferry and from transformers on the same device: fp32 must be identical; bf16 gives
    each prompt's first divergent position (None: identical)."""
    from benchmarks.engine.exactness import first_divergences

    results = {}
    for shape in plan.exact_shapes:
        for dtype in (torch.float32, torch.bfloat16):
            directory = model_dir(plan, work, shape, dtype)
            divergences = first_divergences(str(directory), dtype, plan.device, plan.exact_prompts, plan.exact_tokens)
            results[f"{shape}/{str(dtype).removeprefix('torch.')}"] = {
                "identical": sum(d is None for d in divergences), "prompts": len(divergences),
                "first_divergences": divergences}
    fp32 = [r for name, r in results.items() if name.endswith("float32")]
    return {"fp32_token_exact": all(r["identical"] == r["prompts"] for r in fp32), "runs": results}


def serve(plan: Plan, work: Path) -> dict:
    """`ferry up` on the device (one scheduler per GPU), answering one chat request through the OpenAI API."""
    import httpx

    from ferry.launcher import free_port

    directory = model_dir(plan, work, plan.serve_shape, torch.bfloat16, vocab_size=None)
    http_port = free_port()
    one_scheduler = ["--num-schedulers", "1"] if plan.device == "cpu" else []   # on a GPU: one per GPU, by default
    # on a GPU the pool is sized by profiling, within a share that leaves the steps running beside this one room
    kv_flags = ["--gpu-memory-utilization", "0.3"] if plan.device == "cuda" else ["--kv-cache-memory", str(64 << 20)]
    args = [sys.executable, "-m", "ferry.cli", "up", *one_scheduler, "--model", str(directory),
            "--device", plan.device, "--port", str(free_port()), "--http-port", str(http_port),
            *kv_flags]
    log = open(work / "serve.log", "w")
    stack = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.perf_counter()
        url = f"http://127.0.0.1:{http_port}/v1"
        wait_for_http(f"{url}/models", stack, timeout=240)
        ready = time.perf_counter() - started
        body = {"model": directory.name, "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        asked = time.perf_counter()
        response = httpx.post(f"{url}/chat/completions", json=body, timeout=120)
        answer = response.json()
        return {"ready_s": round(ready, 1), "http_status": response.status_code,
                "request_s": round(time.perf_counter() - asked, 3),
                "completion_tokens": answer.get("usage", {}).get("completion_tokens"),
                "finish_reason": answer.get("choices", [{}])[0].get("finish_reason"),
                "worker_said": [line.split(" INFO ", 1)[-1] for line in (work / "serve.log").read_text().splitlines()
                                if "GPU memory:" in line or "worker ready" in line or "captured" in line],
                "passed": response.status_code == 200 and answer["usage"]["completion_tokens"] > 0}
    finally:
        os.killpg(stack.pid, signal.SIGTERM)
        try:
            stack.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(stack.pid, signal.SIGKILL)
        log.close()


def wait_for_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ferry up exited with code {process.returncode} before serving")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def fixed_workload(count: int, prompt_len: int, output_len: int, vocab: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(vocab // 4, vocab) for _ in range(prompt_len)], output_len)
            for _ in range(count)]


def throughput(plan: Plan, work: Path) -> dict:
    """Ferry (with CUDA graphs, and eager) vs transformers on the same device, fixed lengths: output tokens per
    second, and each run's worker idle time between steps."""
    from benchmarks.engine.offline import ferry_config, run_ferry, run_transformers

    directory = str(model_dir(plan, work, plan.bench_shape, torch.bfloat16))
    requests = fixed_workload(plan.fixed_requests, plan.fixed_prompt, plan.fixed_output, vocab_size(directory))
    runs = {}
    for name, mode in (("ferry", "continuous"), ("ferry_eager", "eager")):
        config = ferry_config(directory, "bfloat16", mode, max_num_seqs=256, kv_cache_memory=kv_bytes(plan, 16))
        config.device = plan.device
        runs[name] = run_ferry(config, mode, requests, progress=False).as_dict()
    runs["transformers"] = run_transformers(directory, "bfloat16", requests[:plan.hf_requests], progress=False,
                                            device=plan.device).as_dict()
    rate = lambda name: runs[name]["output_tokens_per_s"]  # noqa: E731
    return {"model": plan.bench_shape, **runs,
            "ferry_over_transformers": round(rate("ferry") / rate("transformers"), 2),
            "graphs_over_eager": round(rate("ferry") / rate("ferry_eager"), 2)}


def served_async(plan: Plan, work: Path) -> dict:
    """`ferry bench async` on the device (one round): the scheduler service with async scheduling off, on, and on
    with the worker's overlap (the default on a GPU), the shared `mixed` workload (64 requests at once) on a random
    model of SmolLM2's shape and vocabulary; on the CPU a few fixed requests on the tiny model."""
    from benchmarks.common import workloads
    from benchmarks.services.async_scheduling import measure

    directory = str(model_dir(plan, work, plan.serve_shape, torch.bfloat16))
    if plan.device == "cuda":   # the pool: the device's default share (the step runs alone)
        requests, kv_cache_memory = workloads.load("mixed"), 0
    else:
        requests = fixed_workload(4, plan.fixed_prompt, plan.fixed_output, vocab_size(directory))
        kv_cache_memory = 64 << 20
    return measure(requests, directory, "bfloat16", kv_cache_memory=kv_cache_memory, rounds=1)


def vocab_size(directory: str) -> int:
    return json.loads((Path(directory) / "config.json").read_text())["vocab_size"]


def kv_bytes(plan: Plan, gib: float) -> int:
    return int(gib * GiB) if plan.device == "cuda" else 64 << 20


def seeds_claims(plan: Plan, work: Path) -> dict:
    """Continuous vs static batching, and paged vs contiguous KV in the same memory, on long-tailed lengths."""
    from benchmarks.common.workloads import generate
    from benchmarks.engine.offline import ferry_config, run_ferry

    directory = str(model_dir(plan, work, plan.bench_shape, torch.bfloat16))
    requests = [BenchRequest(r.prompt_token_ids, min(r.max_tokens, plan.tailed_max_output))
                for r in generate("sharegpt_shaped", plan.tailed_requests, vocab=(100, vocab_size(directory)))]
    results = {}
    for mode, max_num_seqs, memory in (("continuous", plan.tailed_max_num_seqs, kv_bytes(plan, 4)),
                                       ("static", plan.tailed_max_num_seqs, kv_bytes(plan, 4)),
                                       ("paged", 256, kv_bytes(plan, plan.kv_gib_for_layouts)),
                                       ("contiguous", 256, kv_bytes(plan, plan.kv_gib_for_layouts))):
        engine_mode = "continuous" if mode == "paged" else mode
        config = ferry_config(directory, "bfloat16", engine_mode, max_num_seqs, memory)
        config.device = plan.device
        results[mode] = run_ferry(config, mode, requests, progress=False).as_dict()
    rate = lambda mode: results[mode]["output_tokens_per_s"]  # noqa: E731
    return {"results": results, "continuous_over_static": round(rate("continuous") / rate("static"), 2),
            "paged_over_contiguous": round(rate("paged") / rate("contiguous"), 2),
            "peak_sequences_paged_vs_contiguous": [results["paged"]["peak_running"],
                                                   results["contiguous"]["peak_running"]]}


def roofline(plan: Plan, work: Path) -> dict:
    """The decode step against the memory bound, with CUDA graphs and eager."""
    from benchmarks.engine.roofline import measure_memory_bound

    directory = str(model_dir(plan, work, plan.bench_shape, torch.bfloat16))
    return {mode: measure_memory_bound(directory, "bfloat16", plan.roofline_batch, plan.roofline_prompt,
                                       device=plan.device, kv_cache_memory=kv_bytes(plan, 8),
                                       enforce_eager=mode == "eager").as_dict() for mode in ("graphs", "eager")}


def kernel_bench(plan: Plan, work: Path) -> dict:
    from benchmarks.kernels import kernel_bench as bench

    out = work / "kernel_bench.json"
    bench.main(["--batch", "64", "--contexts", *map(str, plan.kernel_contexts), "--head-dims", "64", "128",
                "--json", str(out)])
    return json.loads(out.read_text()) if out.is_file() else {"skipped": "no CUDA device"}


def lora(plan: Plan, work: Path) -> dict:
    """Multi-LoRA on the device (`ferry bench lora`, one round): output tok/s with 1, 4 and 16 random rank-16
    adapters in the batch against the base model, the adapters' products in the Triton kernels inside the decode
    graphs (the base model's run with LoRA on: what launching them for no row costs)."""
    from benchmarks.engine.lora import measure

    directory = str(model_dir(plan, work, plan.serve_shape, torch.bfloat16))
    counts = [1, 4, 16] if plan.device == "cuda" else [1, 2]
    return measure(directory, "bfloat16", counts, num_requests=plan.lora_requests, prompt_len=plan.fixed_prompt // 2,
                   max_tokens=plan.fixed_output // 2, rounds=1, kv_cache_memory=kv_bytes(plan, 4))


def tensor_parallel(plan: Plan, work: Path) -> dict:
    """`ferry bench tp` on the device: TP=1, and TP=2 over NCCL where the machine has two GPUs (with one, the
    result says that NCCL is untested)."""
    from benchmarks.engine.tensor_parallel import measure

    directory = str(model_dir(plan, work, plan.serve_shape, torch.bfloat16))
    sizes = [1, 2] if plan.device == "cuda" and torch.cuda.device_count() >= 2 else [1]
    result = measure(directory, "bfloat16", sizes, num_requests=plan.lora_requests, prompt_len=plan.fixed_prompt // 2,
                     max_tokens=plan.fixed_output // 2, rounds=1, kv_cache_memory=kv_bytes(plan, 4))
    if sizes == [1]:
        result["nccl"] = "untested: one GPU on this machine"
    return result


STEPS = {"environment": environment, "cuda_tests": cuda_tests, "exactness": exactness, "serve": serve,
         "throughput": throughput, "served_async": served_async, "roofline": roofline, "kernel_bench": kernel_bench,
         "seeds_claims": seeds_claims, "lora": lora, "tensor_parallel": tensor_parallel}
