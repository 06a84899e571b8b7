"""`ferry bench cost-fit`: the cluster simulation's step cost model fitted on this machine.

The real engine (scheduler + worker in one process, the default model unless --model) runs batches of random
prompts of several lengths to completion; every step is timed (schedule, forward, sample, update) and described by
the work the cost model counts (`benchmarks/cluster/cost_model.step_work`: tokens prefilled, sequences decoded, context
read). A least-squares fit of

    seconds = fixed + prefill_token * prefill tokens + decode_seq * decoded sequences + context_token * context

over all steps gives a profile, written as JSON that `ferry bench cluster --profile FILE` reads. `--threads 1`
fits the profile of one of two schedulers sharing this 2-core machine (`ferry up --num-schedulers 2` gives each
worker OMP_NUM_THREADS=1), the one to compare the simulation with the real 2-scheduler stack.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from base.config import EngineConfig
from base.sampling_params import SamplingParams
from benchmarks.cluster.cost_model import CostProfile, StepWork, step_work
from benchmarks.common.cli_args import add_model_args, bench_parser, machine, report
from ferry.engine import Engine

# (sequences, prompt tokens each): decode batches from 1 to 64 over short and long contexts, and prefills that
# fill whole 2,048-token steps
SHAPES = ((1, 128), (1, 1024), (8, 128), (8, 768), (32, 128), (32, 512), (64, 64), (64, 256))
OUTPUT_TOKENS = 12


@dataclass(frozen=True)
class StepSample:
    work: StepWork
    seconds: float


def timed_step(engine: Engine) -> StepSample | None:
    start = time.perf_counter()
    step = engine.scheduler.schedule()
    if step is None:
        return None
    result = engine.worker.step(step)
    engine.scheduler.update(step, result)
    return StepSample(step_work(step), time.perf_counter() - start)


def run_shape(engine: Engine, num_seqs: int, prompt_len: int, seed: int) -> list[StepSample]:
    """num_seqs random prompts of prompt_len tokens (at most what the model takes; random ids, so nothing is
    cached), run to completion."""
    generator = torch.Generator().manual_seed(seed)
    prompt_len = min(prompt_len, engine.info.max_model_len - OUTPUT_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for i in range(num_seqs):
        prompt = torch.randint(100, engine.info.vocab_size, (prompt_len,), generator=generator).tolist()
        engine.add_request(f"fit-{seed}-{i}", prompt, params)
    samples = []
    while engine.has_unfinished_requests():
        sample = timed_step(engine)
        if sample is not None:
            samples.append(sample)
    return samples


def fit(samples: list[StepSample]) -> dict[str, float]:
    """Non-negative least squares by elimination: a term whose coefficient comes out negative is dropped (set to
    0) and the rest refitted, until all are >= 0."""
    names = ("fixed_s", "prefill_token_s", "decode_seq_s", "context_token_s")
    columns = np.array([[1.0, s.work.prefill_tokens, s.work.decode_seqs, s.work.context_tokens] for s in samples])
    seconds = np.array([s.seconds for s in samples])
    active = list(range(len(names)))
    while True:
        coefficients, *_ = np.linalg.lstsq(columns[:, active], seconds, rcond=None)
        if (coefficients >= 0).all():
            break
        active.pop(int(np.argmin(coefficients)))
    fitted = dict.fromkeys(names, 0.0)
    fitted.update({names[i]: float(c) for i, c in zip(active, coefficients)})
    return fitted


def relative_errors(profile: CostProfile, samples: list[StepSample]) -> np.ndarray:
    return np.array([abs(profile.step_seconds(s.work) - s.seconds) / s.seconds for s in samples])


def measure(model: str, dtype: str, threads: int, name: str) -> dict:
    torch.set_num_threads(threads)
    config = EngineConfig(model=model, dtype=dtype, device="cpu")   # Ferry's defaults: 128 seats, the CPU's budget
    engine = Engine(config)
    run_shape(engine, 4, 64, seed=999)   # warm-up, not fitted
    samples = [s for seed, (n, length) in enumerate(SHAPES) for s in run_shape(engine, n, length, seed)]
    coefficients = fit(samples)
    profile = CostProfile(name, **coefficients, kv_blocks=engine.info.num_blocks, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=engine.info.max_num_batched_tokens)
    errors = relative_errors(profile, samples)
    return {"profile": asdict(profile), "threads": threads, "model": engine.info.model_name,
            "num_steps": len(samples), "median_relative_error": round(float(np.median(errors)), 3),
            "p90_relative_error": round(float(np.percentile(errors, 90)), 3)}


def run(args) -> dict:
    result = measure(args.model, args.dtype, args.threads, args.name)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result["profile"], indent=2) + "\n")
    return result


def main(argv: list[str]) -> int:
    parser = bench_parser("cost-fit", __doc__, json_output=True)
    add_model_args(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores; 1: one of two "
                                                                "schedulers sharing a 2-core machine)")
    parser.add_argument("--name", default="cpu_fitted", help="the profile's name")
    parser.add_argument("--out", type=Path, help="write the profile here, for `ferry bench cluster --profile`")
    args = parser.parse_args(argv)
    args.threads = args.threads or os.cpu_count() or 1
    report(args, {"machine": machine(), **run(args)})
    return 0
