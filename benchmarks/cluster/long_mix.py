"""A workload where long prefills meet long decodes, for disaggregated prefill and decode in `ferry bench cluster`
(written to a file for --workload-file): a `long_fraction` of the requests are long documents with short answers
(3,072-6,144 prompt tokens, 32-128 out), the rest chat turns with long answers (128-512 prompt tokens, 256-1,024
out). No two prompts share a prefix: nothing is cached, every prompt is prefilled in full.

    ferry bench long-mix --num-requests 2000 --out long_mix.json
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.common.bench_request import BenchRequest
from benchmarks.common.cli_args import bench_parser
from benchmarks.common.routing_workloads import length_in, token_ids

LONG = ((3072, 6144), (32, 128))       # (prompt tokens, max tokens), inclusive ranges
CHAT = ((128, 512), (256, 1024))


def long_mix(num_requests: int, long_fraction: float = 0.25, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        prompt, out = LONG if rng.random() < long_fraction else CHAT
        requests.append(BenchRequest(token_ids(rng, length_in(rng, prompt)), length_in(rng, out)))
    return requests


def main(argv: list[str]) -> int:
    parser = bench_parser("long-mix", __doc__)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--long-fraction", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    requests = long_mix(args.num_requests, args.long_fraction, args.seed)
    args.out.write_text(json.dumps([{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                                    for r in requests]))
    return 0
