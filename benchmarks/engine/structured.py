"""`ferry bench structured`: what structured outputs cost.

Decode: two engines of the same model and config each hold `batch` prefilled sequences of the same random
prompts; in one every row follows its own JSON schema (the scheduler's grammar matchers fill a token bitmask per
row, the worker masks the logits), in the other no row is constrained. Their decode steps are timed alternately
(one of each per repeat, so machine noise falls on both) while every row still runs, and the medians compared.

Time to first token: one request alone on an idle engine, with a schema never seen before (compiled on the
scheduler's thread pool before the prefill), with the same schema again (xgrammar's compiler cache), and with
no schema, each the median of `trials`.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from base.config import EngineConfig
from base.sampling_params import SamplingParams
from base.structured_output import StructuredOutput
from benchmarks.common.cli_args import add_batch_args, add_model_args, bench_parser, machine, model_dir, report
from ferry.engine import Engine

FIELDS_PER_SCHEMA = 8
STRING_LENGTH = (16, 32)   # characters: every row writes long enough to run through the timed steps


@dataclass
class StructuredResult:
    batch: int
    dtype: str
    constrained_step_ms: float
    unconstrained_step_ms: float
    timed_steps: int
    ttft_cold_schema_ms: float
    ttft_cached_schema_ms: float
    ttft_unconstrained_ms: float

    @property
    def ratio(self) -> float:
        return self.constrained_step_ms / self.unconstrained_step_ms

    def as_dict(self) -> dict:
        return asdict(self) | {"constrained_over_unconstrained": round(self.ratio, 3)}

    def markdown(self) -> str:
        rows = [(f"decode step, batch {self.batch}, every row its own JSON schema", self.constrained_step_ms),
                (f"decode step, batch {self.batch}, unconstrained", self.unconstrained_step_ms),
                ("time to first token, a schema never seen before", self.ttft_cold_schema_ms),
                ("time to first token, the same schema again (cached)", self.ttft_cached_schema_ms),
                ("time to first token, unconstrained", self.ttft_unconstrained_ms)]
        lines = ["| measure | ms |", "|---|---:|", *(f"| {name} | {ms:.2f} |" for name, ms in rows)]
        return "\n".join(lines + [f"| constrained / unconstrained decode step | {self.ratio:.3f}x |"])


def row_schema(row: int) -> str:
    """A JSON schema of its own per row: property names, and which are strings, integers or enums, vary."""
    kinds = [{"type": "string", "minLength": STRING_LENGTH[0], "maxLength": STRING_LENGTH[1]},
             {"type": "integer", "minimum": 0, "maximum": 10 ** (row % 5 + 2)},
             {"enum": [f"v{row}_{k}" for k in range(3)]},
             {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4}]
    properties = {f"field_{row}_{k}": kinds[(row + k) % len(kinds)] for k in range(FIELDS_PER_SCHEMA)}
    return json.dumps({"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False})


def random_prompts(count: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab_size, (prompt_len,), generator=generator).tolist() for _ in range(count)]


def start_rows(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Add the rows and step until all are prefilled and have run their first decode step."""
    for i, (prompt, row_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"row-{i}", prompt, row_params)
    while engine.stats().num_waiting or engine.stats().num_running < len(prompts):
        engine.step()
    engine.step()


def step_seconds(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure_decode(config: EngineConfig, batch: int, prompt_len: int, repeats: int) -> tuple[float, float, int]:
    """Median ms per decode step, constrained and not, over the repeats in which every row of both still ran."""
    constrained, unconstrained = Engine(config), Engine(config)
    prompts = random_prompts(batch, prompt_len, constrained.info.vocab_size, seed=0)
    params = SamplingParams(temperature=0, max_tokens=repeats + 4, ignore_eos=True)
    start_rows(unconstrained, prompts, [params] * batch)
    start_rows(constrained, prompts, [SamplingParams(temperature=0, max_tokens=repeats + 4, structured_output=
                                                     StructuredOutput("json_schema", row_schema(i)))
                                      for i in range(batch)])
    constrained_times, unconstrained_times = [], []
    for _ in range(repeats):   # interleaved
        if constrained.stats().num_running < batch:
            break   # a row finished its JSON: the batches would no longer match
        constrained_times.append(step_seconds(constrained))
        unconstrained_times.append(step_seconds(unconstrained))
    if not constrained_times:
        raise RuntimeError("a constrained row finished before the first timed step")
    return (statistics.median(constrained_times) * 1e3, statistics.median(unconstrained_times) * 1e3,
            len(constrained_times))


def first_token_seconds(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while not any(o.request_id == request_id and (o.new_token_ids or o.finish_reason) for o in engine.step()):
        pass   # the schema compiles off the step loop: until it is ready a step schedules nothing
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def measure_ttft(engine: Engine, prompt_len: int, trials: int) -> tuple[float, float, float]:
    """Median ms to the first token of a lone request on an idle engine: a new schema, the same one again, none."""
    prompts = random_prompts(3 * trials + 1, prompt_len, engine.info.vocab_size, seed=1)   # no prefix cache hits
    one_token = SamplingParams(temperature=0, max_tokens=1)
    first_token_seconds(engine, "warm-up", prompts.pop(), SamplingParams(   # builds xgrammar's tokenizer info
        temperature=0, max_tokens=1, structured_output=StructuredOutput("json_object")))
    cold, cached, free = [], [], []
    for trial in range(trials):
        schema = StructuredOutput("json_schema", row_schema(1000 + trial))
        with_schema = SamplingParams(temperature=0, max_tokens=1, structured_output=schema)
        cold.append(first_token_seconds(engine, f"cold-{trial}", prompts.pop(), with_schema))
        cached.append(first_token_seconds(engine, f"cached-{trial}", prompts.pop(), with_schema))
        free.append(first_token_seconds(engine, f"free-{trial}", prompts.pop(), one_token))
    return tuple(statistics.median(times) * 1e3 for times in (cold, cached, free))


def measure(model_dir: str, dtype: str = "auto", batch: int = 32, prompt_len: int = 64, repeats: int = 32,
            trials: int = 5) -> StructuredResult:
    config = EngineConfig(model=model_dir, dtype=dtype, device="auto", max_num_seqs=batch,
                          max_model_len=prompt_len + repeats + 16)
    constrained_ms, unconstrained_ms, timed = measure_decode(config, batch, prompt_len, repeats)
    engine = Engine(config)
    cold_ms, cached_ms, free_ms = measure_ttft(engine, prompt_len, trials)
    torch_dtype = str(next(engine.worker.runner.model.parameters()).dtype).removeprefix("torch.")
    return StructuredResult(batch, torch_dtype, round(constrained_ms, 3), round(unconstrained_ms, 3), timed,
                            round(cold_ms, 3), round(cached_ms, 3), round(free_ms, 3))


def main(argv: list[str]) -> int:
    parser = bench_parser("structured", __doc__, json_output=True)
    add_model_args(parser)
    add_batch_args(parser, prompt_len=64)
    parser.add_argument("--repeats", type=int, default=32, help="decode steps timed per batch, interleaved")
    parser.add_argument("--trials", type=int, default=5, help="lone requests timed per time-to-first-token case")
    args = parser.parse_args(argv)
    result = measure(model_dir(args), args.dtype, args.batch, args.prompt_len, args.repeats, args.trials)
    if args.json:
        report(args, {"machine": machine(), **result.as_dict()})
    else:
        print(f"{machine()}, {result.dtype}, {result.timed_steps} decode steps timed\n\n{result.markdown()}")
    return 0
