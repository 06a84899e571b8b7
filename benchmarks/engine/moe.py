"""`ferry bench moe`: a decode step of a mixture-of-experts model against a dense model of the same active parameters.

Two tiny random models saved by transformers: a Mixtral (num_experts experts of expert_size, top_k of them per
token) and a Llama whose MLP is top_k * expert_size wide, with the same attention, embeddings and head. A token
multiplies the same number of weights in both, but for the router's (hidden_size x num_experts). Both engines
prefill `batch` prompts, then their decode steps are timed alternately (one of each per repeat, so that machine
noise falls on both), and the medians are compared.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from base.config import EngineConfig
from benchmarks.common.cli_args import add_batch_args, add_dtype_arg, bench_parser, machine, report
from benchmarks.engine.roofline import start_decoding
from ferry.engine import Engine


@dataclass
class MoeShapes:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 512
    vocab_size: int = 1024

    def common(self) -> dict:
        return dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                    vocab_size=self.vocab_size, max_position_embeddings=4096, tie_word_embeddings=False)

    def active_parameters(self, moe: bool) -> int:
        """Weights one token multiplies: attention, MLP (the chosen experts' only) and router, and the LM head."""
        head_dim = self.hidden_size // self.num_heads
        attention = self.hidden_size * (2 * self.hidden_size + 2 * self.num_kv_heads * head_dim)
        mlp = 3 * self.hidden_size * self.top_k * self.expert_size
        router = self.hidden_size * self.num_experts if moe else 0
        return self.num_layers * (attention + mlp + router) + self.hidden_size * self.vocab_size


@dataclass
class MoeStepResult:
    shapes: MoeShapes
    batch: int
    context: int
    dtype: str
    moe_step_ms: float
    dense_step_ms: float
    moe_active_parameters: int
    dense_active_parameters: int

    @property
    def ratio(self) -> float:
        return self.moe_step_ms / self.dense_step_ms

    def as_dict(self) -> dict:
        return asdict(self) | {"moe_over_dense": round(self.ratio, 3)}


def save_models(shapes: MoeShapes, directory: Path) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    configs = {"mixtral": MixtralConfig(**shapes.common(), intermediate_size=shapes.expert_size,
                                        num_local_experts=shapes.num_experts, num_experts_per_tok=shapes.top_k),
               "llama": LlamaConfig(**shapes.common(), intermediate_size=shapes.top_k * shapes.expert_size)}
    for name, config in configs.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory / name)
    return directory / "mixtral", directory / "llama"


def decoding_engine(model_dir: Path, dtype: str, batch: int, prompt_len: int, steps: int) -> Engine:
    """An engine whose `batch` sequences have all been prefilled and decode from the next step on."""
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", max_num_seqs=batch,
                                 max_model_len=prompt_len + steps + 8))
    start_decoding(engine, batch, prompt_len, steps, "moe", lowest_token_id=3)
    return engine


def step_seconds(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure(shapes: MoeShapes, dtype: str = "auto", batch: int = 32, prompt_len: int = 64,
            repeats: int = 32) -> MoeStepResult:
    with tempfile.TemporaryDirectory() as directory:
        moe_dir, dense_dir = save_models(shapes, Path(directory))
        moe = decoding_engine(moe_dir, dtype, batch, prompt_len, repeats)
        dense = decoding_engine(dense_dir, dtype, batch, prompt_len, repeats)
    moe_times, dense_times = [], []
    for _ in range(repeats):   # interleaved
        moe_times.append(step_seconds(moe))
        dense_times.append(step_seconds(dense))
    torch_dtype = next(moe.worker.runner.model.parameters()).dtype
    return MoeStepResult(shapes, batch, prompt_len + 1 + repeats // 2, str(torch_dtype).removeprefix("torch."),
                         round(statistics.median(moe_times) * 1e3, 3), round(statistics.median(dense_times) * 1e3, 3),
                         shapes.active_parameters(moe=True), shapes.active_parameters(moe=False))


def main(argv: list[str]) -> int:
    parser = bench_parser("moe", __doc__, json_output=True)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    add_dtype_arg(parser)
    add_batch_args(parser, prompt_len=64)
    parser.add_argument("--repeats", type=int, default=32, help="decode steps timed per model, interleaved")
    args = parser.parse_args(argv)
    shapes = MoeShapes(hidden_size=args.hidden_size, num_layers=args.layers, num_experts=args.experts,
                       top_k=args.top_k, expert_size=args.expert_size)
    result = measure(shapes, args.dtype, args.batch, args.prompt_len, args.repeats)
    report(args, {"machine": machine(), **result.as_dict()})
    return 0
