"""Engine configuration: one dataclass with defaults; each component reads the fields it knows.

The dataclass is the one source: the command-line flags (add_engine_arguments), the config they parse into
(engine_config), the flags that hand a config to another process (engine_flags) and the worker's wire
InitRequest (init_request) are all generated from its fields. A field's metadata holds what a flag adds:
its help text, its choices, or the flag that turns a default-on switch off (a default-off one on). A field marked
in_process has no flag: only code that builds an EngineConfig itself sets it (the benchmarks' baselines).
"""
from __future__ import annotations

import argparse
from dataclasses import Field, dataclass, field, fields

from protos import worker_pb2

GiB = 1 << 30
DRAIN_TIMEOUT_S = 30.0   # on SIGTERM, how long the router and the schedulers let in-flight requests finish
BATCHING_MODES = ("continuous", "static")
KV_LAYOUTS = ("paged", "contiguous")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class EngineConfig:
    # local HF directory; "" = the default model (SmolLM2-135M-Instruct)
    model: str = field(default="", metadata={"help": "local HF directory; empty: the default model"})
    dtype: str = "auto"                   # float32 | bfloat16 | float16 | auto (gpu_worker.worker.resolve_dtype)
    device: str = "auto"                  # cpu | cuda | auto
    block_size: int = 16
    # bytes for the KV pool; 0 = 1 GiB on CPU, what --gpu-memory-utilization leaves on CUDA
    kv_cache_memory: int = field(default=0, metadata={
        "help": "bytes for the KV cache; 0: 1 GiB on a CPU, what --gpu-memory-utilization leaves on a GPU"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "on a GPU, the fraction of its total memory this worker may use: weights, activations and KV cache"})
    async_scheduling: bool = field(default=True, metadata={
        "switch_off": "--no-async-scheduling",
        "help": "the scheduler service schedules each step while its worker runs the previous one (the default); "
                "off: one step at a time. The in-process Engine always runs one at a time"})
    enforce_eager: bool = field(default=False, metadata={
        "switch_on": "--enforce-eager", "help": "on a GPU, run every step eagerly (no CUDA graphs)"})
    max_model_len: int = 0                # 0 = min(model's max_position_embeddings, 8192)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = field(default=True, metadata={"switch_off": "--no-prefix-caching"})
    announce_prompts: bool = field(default=False, metadata={
        "switch_on": "--announce-prompts",
        "help": "publish a prompt's blocks to the prefix index when admitted, not once computed (many routers)"})
    # static | contiguous: the benchmark baselines (scheduler/baselines.py), set on the in-process Engine only
    batching: str = field(default="continuous", metadata={"choices": BATCHING_MODES, "in_process": True})
    kv_layout: str = field(default="paged", metadata={"choices": KV_LAYOUTS, "in_process": True})
    attention_backend: str = "auto"       # auto | torch | triton
    seed: int = 0
    hash_seed: int = 0                    # seed of the prefix block hash chain
    step_timeout: float = field(default=300.0, metadata={
        "help": "seconds one worker step may take: past it the scheduler replaces its worker (a hung device) and "
                "the router resumes its requests elsewhere"})
    stall_timeout: float = field(default=30.0, metadata={
        "help": "seconds the scheduler may wait on its worker (a step, a restart) before it reports NOT_SERVING "
                "and leaves the registry, until it makes progress again"})
    structured_output_compile_timeout: float = field(default=10.0, metadata={
        "help": "seconds a request may wait for its grammar (JSON schema, regex, ...) to compile, counted from when "
                "xgrammar is loaded, and the longest its grammar may take to find the tokens allowed after one; past "
                "it the request fails with INVALID_ARGUMENT (HTTP 400)"})
    structured_output_compile_workers: int = field(default=2, metadata={
        "help": "grammars compiled at once, those past the timeout included (a compile cannot be stopped): at most "
                "this many cores compile"})

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if min(self.step_timeout, self.stall_timeout) <= 0:
            raise ValueError("step_timeout and stall_timeout must be positive")
        if self.structured_output_compile_timeout <= 0 or self.structured_output_compile_workers < 1:
            raise ValueError("structured_output_compile_timeout must be positive and structured_output_compile_workers "
                             "at least 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")


def flag_name(config_field: Field) -> str:
    return "--" + config_field.name.replace("_", "-")


def flag_fields() -> list[Field]:
    """The EngineConfig fields a command line sets: all but the in_process ones."""
    return [config_field for config_field in fields(EngineConfig) if not config_field.metadata.get("in_process")]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field: --field-name VALUE, or the switch_off / switch_on flag of a bool."""
    for config_field in flag_fields():
        help_text = config_field.metadata.get("help")
        if "switch_off" in config_field.metadata:
            parser.add_argument(config_field.metadata["switch_off"], dest=config_field.name, action="store_false",
                                help=help_text)
        elif "switch_on" in config_field.metadata:
            parser.add_argument(config_field.metadata["switch_on"], dest=config_field.name, action="store_true",
                                help=help_text)
        else:
            parser.add_argument(flag_name(config_field), type=type(config_field.default),
                                default=config_field.default, choices=config_field.metadata.get("choices"),
                                help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = [config_field.name for config_field in flag_fields()]
    return EngineConfig(**{name: getattr(args, name) for name in names})


def engine_flags(config: EngineConfig) -> list[str]:
    """The flags that give another process this config (what add_engine_arguments parses back into it); an
    in_process field has none, so it must be at its default."""
    for config_field in fields(config):
        if config_field.metadata.get("in_process") and getattr(config, config_field.name) != config_field.default:
            raise ValueError(f"{config_field.name} is set in-process only (a benchmark baseline), not by a flag")
    flags = []
    for config_field in flag_fields():
        value = getattr(config, config_field.name)
        if "switch_off" in config_field.metadata:
            flags += [] if value else [config_field.metadata["switch_off"]]
        elif "switch_on" in config_field.metadata:
            flags += [config_field.metadata["switch_on"]] if value else []
        else:
            flags += [flag_name(config_field), str(value)]
    return flags


def init_request(config: EngineConfig) -> worker_pb2.InitRequest:
    """The worker's part of the config: every InitRequest field is the EngineConfig field of the same name."""
    names = worker_pb2.InitRequest.DESCRIPTOR.fields_by_name
    return worker_pb2.InitRequest(**{name: getattr(config, name) for name in names})
