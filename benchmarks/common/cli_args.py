"""What every `ferry bench` benchmark shares: its parser, the workload flags and requests, the model directory, the
machine and dtype a result is labelled with, and the JSON report.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import workloads


def bench_parser(name: str, doc: str, json_output: bool = False) -> argparse.ArgumentParser:
    """The parser of `ferry bench NAME`, described by its module's docstring; json_output: with --json, which prints
    one JSON object rather than the report."""
    parser = argparse.ArgumentParser(prog=f"ferry bench {name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_output:
        parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed",
                        choices=("mixed", "shared_prefix", "mixed_small", "chat", *workloads.ROUTING_WORKLOADS))
    parser.add_argument("--workload-file", type=Path, help="JSON list of {prompt_token_ids, max_tokens}")
    parser.add_argument("--num-requests", type=int)
    add_model_args(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="local HF model directory (default: SmolLM2-135M-Instruct)")
    add_dtype_arg(parser)


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", help="auto: what the worker picks on this machine")


def add_batch_args(parser: argparse.ArgumentParser, prompt_len: int) -> None:
    """The decode batch a step benchmark times: its rows and each one's prompt length."""
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=prompt_len)


def add_rounds_args(parser: argparse.ArgumentParser, num_requests: int, prompt_len: int, max_tokens: int,
                    rounds: int) -> None:
    """Rounds of like requests a throughput benchmark times (the median round is reported)."""
    parser.add_argument("--num-requests", type=int, default=num_requests, help="requests a round, all at once")
    parser.add_argument("--prompt-len", type=int, default=prompt_len, help="prompt tokens a request")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="output tokens a request")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds timed")


def load_requests(args, tokenizer_dir: str | None = None) -> list[workloads.BenchRequest]:
    if args.workload_file:
        requests = workloads.load_workload_file(args.workload_file)
        return requests[:args.num_requests] if args.num_requests else requests
    tokenizer = None
    if args.workload == "chat":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return workloads.load(args.workload, tokenizer, args.num_requests)


def model_dir(args) -> str:
    from gpu_worker.loading.model_files import resolve_model_dir
    return str(resolve_model_dir(args.model))


def report(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


def concrete_dtype(name: str) -> str:
    from gpu_worker.worker import resolve_device, resolve_dtype
    return str(resolve_dtype(name, resolve_device("auto"))).removeprefix("torch.")


def machine() -> str:
    """The device the figures come from (benchmarks are compared on one machine only)."""
    import torch

    from gpu_worker.cpu import cpu_features
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return cpu_features.detect().describe()
