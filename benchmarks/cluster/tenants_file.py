"""A `tenants` workload written to a file (for `ferry bench cluster` and `ferry bench prefix --workload-file`), its
shape set by flags, its token ids folded into a small model's vocabulary where asked: the same file then drives the
real stack on the tiny random model and the simulation, which is how the two are compared (issue 42).

    ferry bench tenants-file --num-tenants 16 --prefix-tokens 256,768 --max-tokens 16,48 --num-requests 96 \\
        --vocab-size 456 --out t16.json
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common.bench_request import BenchRequest
from benchmarks.common.cli_args import bench_parser
from benchmarks.common.routing_workloads import TenantsShape, tenants

RESERVED_IDS = 3   # the tiny tokenizer's special tokens (endoftext, im_start, im_end): never in a folded prompt


def folded(request: BenchRequest, vocab_size: int) -> BenchRequest:
    """The prompt's ids mapped into [RESERVED_IDS, vocab_size); distinct prefixes stay distinct in practice."""
    span = vocab_size - RESERVED_IDS
    return BenchRequest([RESERVED_IDS + t % span for t in request.prompt_token_ids], request.max_tokens)


def int_pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def main(argv: list[str]) -> int:
    parser = bench_parser("tenants-file", __doc__)
    defaults = TenantsShape()
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--num-tenants", type=int, default=defaults.num_tenants)
    parser.add_argument("--prefix-tokens", type=int_pair, default=defaults.prefix_tokens, help="LOW,HIGH")
    parser.add_argument("--question-tokens", type=int_pair, default=defaults.question_tokens, help="LOW,HIGH")
    parser.add_argument("--max-tokens", type=int_pair, default=defaults.max_tokens, help="LOW,HIGH")
    parser.add_argument("--zipf-s", type=float, default=defaults.zipf_s, help="tenant popularity")
    parser.add_argument("--vocab-size", type=int, default=0, help="fold the ids into this vocabulary (0: keep them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    shape = TenantsShape(args.num_tenants, args.prefix_tokens, args.question_tokens, args.max_tokens, args.zipf_s)
    requests = tenants(args.num_requests, args.seed, shape)
    if args.vocab_size:
        requests = [folded(r, args.vocab_size) for r in requests]
    args.out.write_text(json.dumps([{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                                    for r in requests]))
    return 0
