"""`ferry bench lora`: multi-LoRA throughput of the in-process Engine: the same greedy requests spread over 1, 4 or
16 distinct random adapters (every linear PEFT targets, --rank), all in one batch, against the base model alone
(in the same LoRA-enabled engine, and in one without LoRA). Configurations alternate over --rounds; each figure is
the median round's output tokens over the wall time from the first request added to the last finished."""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from benchmarks.common.cli_args import (add_model_args, add_rounds_args, bench_parser, concrete_dtype, machine,
                                        model_dir, report)
from ferry import Engine, EngineConfig, SamplingParams

PEFT_MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear PEFT targets, for a Llama-shaped config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inner = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}


def write_random_adapter(directory: Path, config, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of random weights on every linear of every layer (a fine-tune's shape, not its values)."""
    generator = torch.Generator().manual_seed(seed)
    shapes, tensors = module_shapes(config), {}
    for layer in range(config.num_hidden_layers):
        for block, modules in PEFT_MODULES.items():
            for module in modules:
                fan_in, fan_out = shapes[module]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m for modules in PEFT_MODULES.values() for m in modules]}))
    return directory


def requests(num: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab_size - 10, (prompt_len,), generator=generator).tolist() for _ in range(num)]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, adapters: list[str]) -> float:
    """Output tokens per second with the prompts given to the adapters in turn ([""]: the base model)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    results = engine.generate(prompts, params, lora_names=[adapters[i % len(adapters)] for i in range(len(prompts))])
    seconds = time.perf_counter() - started
    return sum(len(r.token_ids) for r in results) / seconds


def measure(directory: str, dtype: str, counts: list[int], rank: int = 16, num_requests: int = 32,
            prompt_len: int = 128, max_tokens: int = 64, rounds: int = 2, kv_cache_memory: int = 0) -> dict:
    """The figures of `ferry bench lora` (main's flags); kv_cache_memory: each of its two engines' pool (0: the
    device's default, which on a GPU leaves the second engine nothing)."""
    config = AutoConfig.from_pretrained(directory)
    prompts = requests(num_requests, prompt_len, config.vocab_size)
    common = dict(model=directory, dtype=dtype, max_num_seqs=max(num_requests, 1), enable_prefix_caching=False,
                  kv_cache_memory=kv_cache_memory)
    with tempfile.TemporaryDirectory() as scratch:
        names = [f"lora{i}" for i in range(max(counts))]
        modules = [f"{name}={write_random_adapter(Path(scratch) / name, config, rank, i)}"
                   for i, name in enumerate(names)]
        engines = {"no-lora": Engine(EngineConfig(**common)),
                   "lora": Engine(EngineConfig(**common, enable_lora=True, lora_modules=modules,
                                               max_loras=max(counts), max_lora_rank=rank))}
        plan = {"base (LoRA off)": ("no-lora", [""]), "base (LoRA on)": ("lora", [""]),
                **{f"{count} adapters": ("lora", names[:count]) for count in counts}}
        for engine in engines.values():   # warm-up: every adapter placed once
            run(engine, prompts[:max(counts)], 2, names if engine.config.enable_lora else [""])
        for engine, adapters in plan.values():   # and each mix's shapes compiled (Triton, on a GPU) before timing
            run(engines[engine], prompts, 2, adapters)
        figures: dict[str, list[float]] = {label: [] for label in plan}
        for round_index in range(rounds):
            for label, (engine, adapters) in plan.items():
                figures[label].append(run(engines[engine], prompts, max_tokens, adapters))
                print(f"[bench] round {round_index}: {label}: {figures[label][-1]:.1f} tok/s", file=sys.stderr)
    tok_s = {label: round(statistics.median(values), 1) for label, values in figures.items()}
    base = tok_s["base (LoRA off)"]
    return {"machine": machine(), "dtype": dtype, "rank": rank, "num_requests": num_requests, "prompt_len": prompt_len,
            "max_tokens": max_tokens, "output_tokens_per_s": tok_s,
            "ratio_to_base": {label: round(value / base, 3) for label, value in tok_s.items()}}


def main(argv: list[str]) -> int:
    parser = bench_parser("lora", __doc__, json_output=True)
    add_model_args(parser)
    parser.add_argument("--adapters", default="1,4,16", help="comma list of distinct adapters in the batch")
    parser.add_argument("--rank", type=int, default=16)
    add_rounds_args(parser, num_requests=32, prompt_len=128, max_tokens=64, rounds=2)
    parser.add_argument("--kv-cache-memory", type=int, default=0, help="bytes of each engine's pool (0: default)")
    args = parser.parse_args(argv)
    report(args, measure(model_dir(args), concrete_dtype(args.dtype), [int(c) for c in args.adapters.split(",")],
                         args.rank, args.num_requests, args.prompt_len, args.max_tokens, args.rounds,
                         args.kv_cache_memory))
    return 0
