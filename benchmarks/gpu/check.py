"""`ferry bench gpu-check` (scripts/gpu_check.sh): Ferry on one NVIDIA GPU, every step a process of its own, one
JSON summary.

    ferry bench gpu-check OUT_DIR [--budget-s 500] [--work-dir DIR] [--smoke]

First the checks that need no quiet device run side by side (the GPU-only tests, token-exactness against
transformers, `ferry up` answering a chat request); then the timed steps one at a time (Ferry with CUDA graphs
and eager vs transformers, the scheduler service with async scheduling off, on and overlapped, the decode step
against the memory bound, the decode kernel's bandwidth, continuous vs static and paged vs contiguous, multi-LoRA
against the base model, tensor parallelism). Each step ends by its own timeout or the
budget's, whichever comes first, and OUT_DIR/summary.json is rewritten after each, so a run cut short still says
what it found; each step's log is OUT_DIR/logs/STEP.log. The random models are written under --work-dir (a
temporary folder by default).
--smoke: the same steps at tiny shapes on the CPU (what the tests run, so that the GPU's minutes are never the
first time a step runs).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common.cli_args import bench_parser
from benchmarks.gpu import steps as gpu_steps

# (step, its own timeout in seconds); the first group runs side by side, the second in order
SIDE_BY_SIDE = [("cuda_tests", 240), ("exactness", 200), ("serve", 240)]
IN_ORDER = [("throughput", 200), ("served_async", 150), ("roofline", 100), ("kernel_bench", 90), ("seeds_claims", 200),
            ("lora", 150), ("tensor_parallel", 120)]
RESULT_PREFIX = "GPU_CHECK_RESULT "


def run_step(name: str, timeout: float, work: Path, logs: Path, smoke: bool) -> dict:
    """One step in a child process; its result is the JSON line it prints last, its output goes to logs/name.log."""
    if timeout <= 1:
        return {"status": "not run: no time left in the budget"}
    started = time.perf_counter()
    args = [sys.executable, "-m", "benchmarks", "gpu-check", "--step", name, "--work", str(work)]
    with open(logs / f"{name}.log", "w") as log:
        try:
            run = subprocess.run(args + (["--smoke"] if smoke else []), stdout=subprocess.PIPE, stderr=log,
                                 text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            log.write(expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or "")
            return {"status": f"timed out after {timeout:.0f} s", "seconds": round(time.perf_counter() - started, 1)}
        log.write(run.stdout)
    seconds = round(time.perf_counter() - started, 1)
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if run.returncode or not lines:
        return {"status": f"failed (exit code {run.returncode})", "seconds": seconds,
                "error": tail(logs / f"{name}.log")}
    return {"status": "ok", "seconds": seconds, **json.loads(lines[-1].removeprefix(RESULT_PREFIX))}


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_all(out: Path, work: Path, budget_s: float, smoke: bool) -> dict:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    left = lambda timeout: min(timeout, deadline - time.monotonic())  # noqa: E731
    summary = {"plan": "smoke" if smoke else "gpu", "steps": {}}
    summary["steps"]["environment"] = run_step("environment", left(60), work, logs, smoke)
    write(out, summary)
    with ThreadPoolExecutor(len(SIDE_BY_SIDE)) as pool:
        futures = {name: pool.submit(run_step, name, left(timeout), work, logs, smoke)
                   for name, timeout in SIDE_BY_SIDE}
        for name, future in futures.items():
            summary["steps"][name] = future.result()
            write(out, summary)
    for name, timeout in IN_ORDER:
        summary["steps"][name] = run_step(name, left(timeout), work, logs, smoke)
        write(out, summary)
    for log in work.glob("*.log"):   # what the steps' own children wrote (the served stack's)
        shutil.copy(log, logs)
    summary["all_ok"] = all(step["status"] == "ok" and step.get("passed", True) is not False
                            for step in summary["steps"].values())
    write(out, summary)
    return summary


def write(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


def run_one(name: str, work: Path, smoke: bool) -> None:
    plan = gpu_steps.SMOKE_PLAN if smoke else gpu_steps.GPU_PLAN
    result = gpu_steps.STEPS[name](plan, work)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main(argv: list[str]) -> int:
    parser = bench_parser("gpu-check", __doc__)
    parser.add_argument("out", nargs="?", help="folder for summary.json and the steps' logs")
    parser.add_argument("--budget-s", type=float, default=500.0, help="all steps together end within this")
    parser.add_argument("--work-dir", help="where the random models are written (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--step", choices=sorted(gpu_steps.STEPS), help=argparse.SUPPRESS)   # a child's own step
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        run_one(args.step, Path(args.work), args.smoke)
        return 0
    if not args.out:
        parser.error("OUT_DIR is required")
    with tempfile.TemporaryDirectory(prefix="ferry-gpu-check-") as scratch:
        summary = run_all(Path(args.out), Path(args.work_dir or scratch), args.budget_s, args.smoke)
    for name, step in summary["steps"].items():
        print(f"[gpu_check] {name}: {step['status']} ({step.get('seconds', 0)} s)", flush=True)
    return 0 if summary["all_ok"] else 1

