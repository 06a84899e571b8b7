"""scripts/gpu_check.sh's plumbing on the CPU: every step runs at tiny shapes, so that the few minutes a GPU is lent
are never the first time a step runs (the GPU run itself: BENCHMARKS.md, GPU section)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"environment", "cuda_tests", "exactness", "serve", "throughput", "served_async", "roofline",
         "kernel_bench", "seeds_claims", "lora", "tensor_parallel"}


def test_every_step_of_the_gpu_check_runs_at_tiny_shapes_and_reports_in_one_summary(tmp_path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"PYTHON": sys.executable, "FERRY_GPU_WHEELS": str(tmp_path / "no-wheels")}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    summary = json.loads((out / "summary.json").read_text())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert set(summary["steps"]) == STEPS and summary["all_ok"]
    assert summary["steps"]["exactness"]["fp32_token_exact"]
    assert summary["steps"]["serve"]["http_status"] == 200
    claims = summary["steps"]["seeds_claims"]
    assert claims["results"]["static"]["output_tokens"] == claims["results"]["continuous"]["output_tokens"] > 0
    assert set(summary["steps"]["lora"]["output_tokens_per_s"]) == {"base (LoRA off)", "base (LoRA on)", "1 adapters",
                                                                    "2 adapters"}
    served_async = summary["steps"]["served_async"]   # the three modes served the same requests, none failed
    assert [r["mode"] for r in served_async["rounds"]] == ["on", "off", "overlap"]
    assert all(r["output_tokens_per_s"] > 0 for r in served_async["rounds"])
    tensor_parallel = summary["steps"]["tensor_parallel"]   # one GPU, or none: TP=1 only, NCCL said untested
    assert set(tensor_parallel["figures"]) == {"1"} and tensor_parallel["nccl"].startswith("untested")
    with tarfile.open(out / "logs.tgz") as logs:
        assert {f"logs/{step}.log" for step in STEPS} <= set(logs.getnames())


def test_steps_past_the_budget_are_reported_as_not_run_and_the_check_fails(tmp_path) -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks", "gpu-check", str(tmp_path), "--smoke", "--budget-s", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert run.returncode == 1 and not summary["all_ok"]
    assert all(step["status"].startswith("not run") for step in summary["steps"].values())
