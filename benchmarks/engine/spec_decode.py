"""`ferry bench spec-decode`: n-gram (prompt lookup) speculative decoding on against off, in Ferry's in-process
Engine, on a copy-heavy workload (benchmarks/common/copy_workloads.py). At each concurrency level B the bench keeps B
requests in flight (a new one added as one finishes) until the level's requests have run, greedy with EOS honoured;
both modes run every level, one after the other, in alternating order, each level on requests of its own.

Per level and mode: output tok/s over the wall time; inter-token latency as a user sees it (per request,
(last token time - first token time) / (tokens - 1): the tokens a step emits together arrive together), its median
and p90 over requests; the median time to first token; the drafts' acceptance (accepted / proposed, tokens accepted per
request-step and per draft, the share of drafts whose token i was kept); the on/off ratios; and the requests whose
tokens differ between the modes (greedy: there should be none, exactness is part of the result). By default the
engine drafts only at batch sizes where its measurements say drafts pay (scheduler/speculation_payoff.py);
--disable-by-batch-size N drafts below N sequences and never at N or more (a large N: at any batch size).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field

from benchmarks.common import copy_workloads
from benchmarks.common.cli_args import add_model_args, bench_parser, concrete_dtype, machine, model_dir, report
from benchmarks.common.workloads import BenchRequest
from benchmarks.engine.offline import warm_up
from ferry import Engine, EngineConfig, SamplingParams

MODES = ("off", "on")
WARM_UP = 2   # requests of the workload each engine runs before the timed levels


@dataclass
class Timeline:
    """One request as its user sees it: when it was added, and when its tokens arrived."""
    added: float
    token_ids: list[int] = field(default_factory=list)
    first: float = 0.0
    last: float = 0.0
    steps: int = 0             # steps that gave it tokens
    first_step_tokens: int = 0

    def receive(self, now: float, token_ids: list[int]) -> None:
        if not self.token_ids:
            self.first, self.first_step_tokens = now, len(token_ids)
        self.token_ids += token_ids
        self.last = now
        self.steps += 1

    @property
    def ttft(self) -> float:
        return self.first - self.added

    @property
    def itl(self) -> float | None:
        n = len(self.token_ids)
        return (self.last - self.first) / (n - 1) if n > 1 else None


@dataclass
class SpecCounters:
    drafts: int = 0        # proposals verified
    proposed: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)   # [i]: proposals whose token i was kept

    @classmethod
    def read(cls, engine: Engine) -> SpecCounters:
        counters = engine.scheduler.counters   # without speculation (or before it existed): zeros
        return cls(*(getattr(counters, f"spec_{name}", 0) for name in ("drafts", "proposed_tokens", "accepted_tokens")),
                   list(getattr(counters, "spec_accepted_by_position", [])))

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.by_position), len(other.by_position))
        pad = lambda xs: xs + [0] * (width - len(xs))  # noqa: E731
        return SpecCounters(self.drafts - other.drafts, self.proposed - other.proposed, self.accepted - other.accepted,
                            [a - b for a, b in zip(pad(self.by_position), pad(other.by_position))])


def speculative_config(args) -> str:
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
              "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if args.disable_by_batch_size is not None:
        config["disable_by_batch_size"] = args.disable_by_batch_size
    return json.dumps(config)


def build_engine(args, directory: str, dtype: str, mode: str, warm_up_requests: list[BenchRequest]) -> Engine:
    """An engine warmed up on requests of the workload's shape (its first prefills of such prompts cost many times
    a later one's), which the timed levels do not run."""
    spec = {"speculative_config": speculative_config(args)} if mode == "on" else {}
    engine = Engine(EngineConfig(model=directory, dtype=dtype, device="auto", max_num_seqs=max(args.batch_sizes),
                                 kv_cache_memory=args.kv_cache_memory, **spec))
    warm_up(engine)
    engine.generate([r.prompt_token_ids for r in warm_up_requests],
                    SamplingParams(temperature=0, max_tokens=min(16, args.max_tokens), ignore_eos=True))
    return engine


def run_level(engine: Engine, requests: list[BenchRequest], batch: int, tag: str) -> tuple[list[Timeline], float]:
    """Keeps `batch` requests in flight until all have run; their timelines in order, and the wall time."""
    timelines: list[Timeline] = []

    def add_next() -> None:
        request = requests[len(timelines)]
        timelines.append(Timeline(time.perf_counter()))
        engine.add_request(f"{tag}-{len(timelines) - 1}", request.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=False))

    started = time.perf_counter()
    for _ in range(min(batch, len(requests))):
        add_next()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                timelines[int(out.request_id.rsplit("-", 1)[1])].receive(now, list(out.new_token_ids))
            if out.finish_reason and len(timelines) < len(requests):
                add_next()
    return timelines, time.perf_counter() - started


def percentile_ms(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return round(values[0] * 1e3, 3) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3, 3)


def summarize(timelines: list[Timeline], seconds: float, spec: SpecCounters) -> dict:
    tokens = sum(len(t.token_ids) for t in timelines)
    itls = [t.itl for t in timelines if t.itl is not None]
    decode_steps = sum(max(0, t.steps - 1) for t in timelines)        # request-steps after the first token
    decode_tokens = sum(len(t.token_ids) - t.first_step_tokens for t in timelines)
    return {"num_requests": len(timelines), "output_tokens": tokens, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 2), "itl_ms_median": percentile_ms(itls, 50),
            "itl_ms_p90": percentile_ms(itls, 90),
            "ttft_ms_median": percentile_ms([t.ttft for t in timelines if t.token_ids], 50),
            "tokens_per_step": round(decode_tokens / decode_steps, 3) if decode_steps else None,
            "spec_drafts": spec.drafts, "spec_proposed_tokens": spec.proposed, "spec_accepted_tokens": spec.accepted,
            "acceptance_rate": round(spec.accepted / spec.proposed, 4) if spec.proposed else None,
            "mean_accepted_per_step": round(spec.accepted / decode_steps, 3) if decode_steps else None,
            "mean_accepted_per_draft": round(spec.accepted / spec.drafts, 3) if spec.drafts else None,
            "spec_accepted_by_position": spec.by_position,
            "acceptance_by_position": [round(n / spec.drafts, 4) for n in spec.by_position] if spec.drafts else []}


def mismatches(off: list[Timeline], on: list[Timeline]) -> list[dict]:
    """The requests whose greedy tokens differ between the modes, each with the first position they differ at."""
    found = []
    for i, (a, b) in enumerate(zip(off, on)):
        if a.token_ids != b.token_ids:
            first = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                         min(len(a.token_ids), len(b.token_ids)))
            found.append({"request": i, "first_difference": first, "off_tokens": len(a.token_ids),
                          "on_tokens": len(b.token_ids)})
    return found


def ratio(on: float | None, off: float | None) -> float | None:
    return round(on / off, 3) if on and off else None


def run(args, engines: dict[str, Engine], levels: list[tuple[int, list[BenchRequest]]]) -> list[dict]:
    results = []
    for index, (batch, requests) in enumerate(levels):
        order = MODES if index % 2 == 0 else MODES[::-1]   # alternate which mode runs first
        entry, timelines = {"batch": batch, "num_requests": len(requests)}, {}
        for mode in order:
            before = SpecCounters.read(engines[mode])
            timelines[mode], seconds = run_level(engines[mode], requests, batch, f"level{index}")
            entry[mode] = summarize(timelines[mode], seconds, SpecCounters.read(engines[mode]) - before)
            print(f"[bench] batch {batch} spec {mode}: {entry[mode]['output_tokens_per_s']} tok/s, ITL median "
                  f"{entry[mode]['itl_ms_median']} ms, acceptance {entry[mode]['acceptance_rate']}", file=sys.stderr)
        entry["ratios"] = {"output_tokens_per_s_on_over_off": ratio(entry["on"]["output_tokens_per_s"],
                                                                    entry["off"]["output_tokens_per_s"]),
                           "itl_median_on_over_off": ratio(entry["on"]["itl_ms_median"], entry["off"]["itl_ms_median"]),
                           "itl_p90_on_over_off": ratio(entry["on"]["itl_ms_p90"], entry["off"]["itl_ms_p90"])}
        entry["mismatched"] = mismatches(timelines["off"], timelines["on"])
        entry["mismatches"] = len(entry["mismatched"])
        results.append(entry)
    return results


def parse_args(argv: list[str]):
    parser = bench_parser("spec-decode", __doc__, json_output=True)
    parser.add_argument("--workload", default="copy", choices=tuple(copy_workloads.PROMPTS),
                        help="copy: templated passages and functions; real-text: prose of the Python reference; "
                             "novel: open-ended requests that quote nothing")
    parser.add_argument("--batch-sizes", default="1,4,32", type=lambda s: [int(b) for b in s.split(",")],
                        help="comma list of concurrency levels: requests kept in flight")
    parser.add_argument("--num-requests", type=int, default=0, help="per level; 0: max(2 x batch, 8)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts proposed per step at most")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram matched")
    parser.add_argument("--prompt-lookup-max", type=int, default=5, help="longest n-gram matched")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="draft below this many running sequences, never at it or more; default: where the "
                             "engine's measured payoff says drafts pay")
    parser.add_argument("--kv-cache-memory", type=int, default=0, help="bytes (0: the default)")
    parser.add_argument("--seed", type=int, default=0, help="of the workload")
    add_model_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    directory, dtype = model_dir(args), concrete_dtype(args.dtype)
    counts = [args.num_requests or max(2 * b, 8) for b in args.batch_sizes]
    from transformers import AutoTokenizer
    workload = copy_workloads.load(args.workload, AutoTokenizer.from_pretrained(directory), sum(counts) + WARM_UP,
                                   args.max_tokens, args.seed)
    starts = [WARM_UP + sum(counts[:i]) for i in range(len(counts))]
    levels = [(b, workload[s:s + n]) for b, s, n in zip(args.batch_sizes, starts, counts)]
    engines = {mode: build_engine(args, directory, dtype, mode, workload[:WARM_UP]) for mode in MODES}
    results = run(args, engines, levels)
    report(args, {"workload": args.workload, "seed": args.seed, "max_tokens": args.max_tokens, "dtype": dtype,
                  "model": args.model or "SmolLM2-135M-Instruct", "machine": machine(),
                  "speculative_config": json.loads(speculative_config(args)), "levels": results,
                  "mismatches": sum(level["mismatches"] for level in results)})
    return 0
