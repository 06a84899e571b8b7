"""`ferry bench roofline`: a decode step against the machine's FLOP limit (CPU) or its memory bound (GPU).

The limit of a decode step is its arithmetic over the fastest a large fp32 (or the model's dtype) matmul runs on
the same cores: 2 x (the linear layers' parameters, LM head included) x batch, plus attention's 4 x layers x heads x
head_dim x context per sequence. The step is the engine's own: `batch` requests of `prompt_len` random tokens,
prefilled first, then timed over `steps` decode steps while every sequence runs.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from transformers import AutoConfig

from benchmarks.common.cli_args import (
    add_batch_args,
    add_model_args,
    bench_parser,
    concrete_dtype,
    machine,
    model_dir,
    report,
)
from ferry import Engine, EngineConfig, SamplingParams
from gpu_worker.model import ModelShape


@dataclass
class Roofline:
    dtype: str
    batch: int
    context: int
    peak_gflop_s: float
    step_gflop: float
    step_ms: float

    @property
    def limit_ms(self) -> float:
        return self.step_gflop / self.peak_gflop_s * 1e3

    def as_dict(self) -> dict:
        return {**asdict(self), "limit_ms": round(self.limit_ms, 4),
                "step_over_limit": round(self.step_ms / self.limit_ms, 2)}


def peak_matmul_gflop_s(dtype: torch.dtype, size: int = 4096, repeats: int = 5) -> float:
    """The best of `repeats` square matmuls: what the cores do at their fastest on large operands."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def linear_parameters(model: torch.nn.Module) -> int:
    """Every weight a token is multiplied by: the linears and the LM head (tied or not), not the embedding lookup;
    a linear that holds another (a quantized one and its fp32 twin for large batches) counts once."""
    return sum(module.in_features * module.out_features for module in model.modules()
               if is_linear(module) and not any(is_linear(child) for child in module.children()))


def is_linear(module: torch.nn.Module) -> bool:
    return hasattr(module, "in_features") and hasattr(module, "out_features")


def decode_step_gflop(model, shape: ModelShape, batch: int, context: int) -> float:
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * context * batch
    return (2 * linear_parameters(model) * batch + attention) / 1e9


def start_decoding(engine: Engine, batch: int, prompt_len: int, steps: int, name: str, lowest_token_id: int) -> None:
    """Adds `batch` random prompts (seeded, token ids from lowest_token_id up) that decode `steps` tokens and more,
    and steps the engine until all are prefilled and the first decode step has run."""
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(lowest_token_id, engine.info.vocab_size, (prompt_len,), generator=generator).tolist()
        engine.add_request(f"{name}-{i}", prompt, params)
    while engine.stats().num_waiting or engine.stats().num_running < batch:
        engine.step()
    engine.step()   # the first decode step, after the last prefill


def measure(model_dir: str, dtype: str = "auto", batch: int = 32, prompt_len: int = 128, steps: int = 32,
            matmul_size: int = 4096) -> Roofline:
    engine = Engine(EngineConfig(model=model_dir, dtype=dtype, device="cpu", max_num_seqs=batch))
    start_decoding(engine, batch, prompt_len, steps, "roofline", lowest_token_id=100)
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        durations.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    model = engine.worker.runner.model
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(engine.info.model_path))
    torch_dtype = next(model.parameters()).dtype
    context = prompt_len + 1 + steps // 2
    return Roofline(dtype=str(torch_dtype).removeprefix("torch."), batch=batch, context=context,
                    peak_gflop_s=round(peak_matmul_gflop_s(torch_dtype, matmul_size), 1),
                    step_gflop=round(decode_step_gflop(model, shape, batch, context), 6),
                    step_ms=round(sorted(durations)[len(durations) // 2] * 1e3, 1))


@dataclass
class MemoryRoofline:
    """A decode step against the memory bound: every weight and every context token's K and V read once, at the
    device-to-device copy bandwidth measured on the same device (the bound of a GPU decode step)."""
    device: str
    dtype: str
    batch: int
    context: int
    copy_gb_s: float
    weight_gb: float
    kv_gb: float
    step_ms: float
    forward_ms: float

    @property
    def limit_ms(self) -> float:
        return (self.weight_gb + self.kv_gb) / self.copy_gb_s * 1e3

    def as_dict(self) -> dict:
        return {**asdict(self), "limit_ms": round(self.limit_ms, 4),
                "step_over_limit": round(self.step_ms / self.limit_ms, 2),
                "forward_over_limit": round(self.forward_ms / self.limit_ms, 2)}


def copy_bandwidth_gb_s(device: torch.device, repeats: int = 10) -> float:
    """Bytes read plus bytes written per second by a large device-to-device copy (the best of `repeats`): 1 GiB on
    a GPU, far past its caches; 64 MiB on a CPU, where only the plumbing is checked."""
    size = 1 << 30 if device.type == "cuda" else 1 << 26
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(timed(lambda: synchronized(device, lambda: target.copy_(source))) for _ in range(repeats))
    return 2 * size / best / 1e9


def synchronized(device: torch.device, fn) -> None:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory_bound(model_dir: str, dtype: str = "bfloat16", batch: int = 64, prompt_len: int = 512,
                         steps: int = 32, device: str = "cuda", kv_cache_memory: int = 0,
                         enforce_eager: bool = False) -> MemoryRoofline:
    engine = Engine(EngineConfig(model=model_dir, dtype=dtype, device=device, max_num_seqs=batch,
                                 kv_cache_memory=kv_cache_memory, enforce_eager=enforce_eager))
    start_decoding(engine, batch, prompt_len, steps, "roofline", lowest_token_id=100)
    walls, forwards = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        forwards.append(engine.last_step_seconds)
    model = engine.worker.runner.model
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(engine.info.model_path))
    torch_dtype = next(model.parameters()).dtype
    element = torch.empty((), dtype=torch_dtype).element_size()
    context = prompt_len + 1 + steps // 2
    kv_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element * context * batch
    target = torch.device(device)
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return MemoryRoofline(device=torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu",
                          dtype=str(torch_dtype).removeprefix("torch."), batch=batch, context=context,
                          copy_gb_s=round(copy_bandwidth_gb_s(target), 1),
                          weight_gb=round(linear_parameters(model) * element / 1e9, 4), kv_gb=round(kv_bytes / 1e9, 4),
                          step_ms=round(median(walls), 3), forward_ms=round(median(forwards), 3))


def main(argv: list[str]) -> int:
    """On a GPU the decode step against the memory bound (weights and KV read at the measured bandwidth), on a CPU
    against the FLOP limit."""
    parser = bench_parser("roofline", __doc__, json_output=True)
    add_model_args(parser)
    add_batch_args(parser, prompt_len=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed (the median is reported)")
    parser.add_argument("--matmul-size", type=int, default=4096, help="the square fp32 matmul that sets the peak")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        result = measure_memory_bound(model_dir(args), concrete_dtype(args.dtype), args.batch, args.prompt_len,
                                      args.steps)
    else:
        result = measure(model_dir(args), args.dtype, args.batch, args.prompt_len, args.steps, args.matmul_size)
    report(args, {"machine": machine(), **result.as_dict()})
    return 0
