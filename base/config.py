"""Engine configuration: one dataclass with defaults; each component reads the fields it knows.

The dataclass is the one source (base/options.py): the command-line flags, the config they parse into, the flags
that hand a config to another process, and the worker's wire InitRequest (init_request) are all generated from its
fields. A field's metadata holds what a flag adds: its help text, its choices, or the flag that turns a default-on
switch off (a default-off one on). A field marked in_process has no flag: only code that builds an EngineConfig
itself sets it (the benchmarks' baselines).
"""
from __future__ import annotations

from dataclasses import dataclass

from base.options import option
from base.speculative import parse_speculative_config
from protos import worker_pb2

GiB = 1 << 30
DRAIN_TIMEOUT_S = 30.0   # on SIGTERM, how long the router and the schedulers let in-flight requests finish
BATCHING_MODES = ("continuous", "static")
KV_LAYOUTS = ("paged", "contiguous")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
WORKER_OVERLAP = ("auto", "on", "off")
# --max-num-batched-tokens 0 (auto) by device: at 32 streams of 512-token prompts on a 2-core CPU, 1024 gave a median
# time to first token 1.4x shorter than 2048 at the same throughput and ITL median (BENCHMARKS.md)
STEP_TOKENS = {"cpu": 1024, "cuda": 2048}
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")


def step_tokens(configured: int, device_type: str) -> int:
    """The step's token budget: as configured, or (0) the device's default."""
    return configured or STEP_TOKENS.get(device_type, STEP_TOKENS["cuda"])


@dataclass
class EngineConfig:
    model: str = option("", "local HF directory or .gguf file; empty: the default model (SmolLM2-135M-Instruct)")
    served_model_name: list[str] = option([], "the model's name(s) in the API: requests may name any, responses "
                                              "name the first; none: the model directory's name",
                                          repeat=True, many=True, metavar="NAME")
    dtype: str = option("auto", "the dtype weights and activations are computed in; auto: bfloat16 on a GPU and on "
                                "CPUs that multiply it natively, else float32", choices=DTYPES)
    device: str = option("auto", "where the worker runs; auto: a GPU where there is one", choices=DEVICES)
    block_size: int = option(16, "tokens per KV cache block (a power of two)")
    kv_cache_memory: int = option(0, "bytes for the KV cache; 0: 1 GiB on a CPU, what --gpu-memory-utilization "
                                     "leaves on a GPU")
    gpu_memory_utilization: float = option(0.9, "on a GPU, the fraction of its total memory this worker may use: "
                                                "weights, activations and KV cache")
    async_scheduling: bool = option(True, "the scheduler service schedules each step while its worker runs the "
                                          "previous one; off: one step at a time. The in-process Engine always "
                                          "runs one at a time", switch_off="--no-async-scheduling")
    worker_overlap: str = option("auto", "the worker launches each step on the device before the previous step's "
                                         "tokens are back on the host, feeding them there (with async "
                                         "scheduling); auto: on a GPU, without tensor parallelism or a draft "
                                         "model. On a CPU a step's tokens are ready when it ends: on only holds "
                                         "results back", choices=WORKER_OVERLAP)
    enforce_eager: bool = option(False, "on a GPU, run every step eagerly (no CUDA graphs)",
                                 switch_on="--enforce-eager")
    max_model_len: int = option(0, "longest sequence, prompt and output, in tokens; 0: the model's "
                                   "max_position_embeddings, at most 8192")
    max_num_seqs: int = option(128, "sequences in the running batch at most")
    max_num_batched_tokens: int = option(0, "tokens one step computes at most (its prefill chunks and decodes); 0 "
                                            "(auto): 1024 on a CPU, where a step's time grows with its tokens and "
                                            "a smaller one brings a burst's first tokens sooner, 2048 on a GPU")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a prompt's cached prefix",
                                         switch_off="--no-prefix-caching")
    announce_prompts: bool = option(False, "publish a prompt's blocks to the prefix index when admitted, not once "
                                           "computed (many routers)", switch_on="--announce-prompts")
    batching: str = option("continuous", "continuous, or static: the benchmark baseline that admits a new batch "
                                         "only when the last has finished (scheduler/baselines.py)",
                           choices=BATCHING_MODES, in_process=True)
    kv_layout: str = option("paged", "paged, or contiguous: the benchmark baseline that reserves --max-model-len "
                                     "for every sequence (scheduler/baselines.py)", choices=KV_LAYOUTS,
                            in_process=True)
    attention_backend: str = option("auto", "the attention kernels; auto: triton on a GPU, torch on a CPU",
                                    choices=ATTENTION_BACKENDS)
    seed: int = option(0, "seed of the worker's sampling, for requests without a seed of their own")
    hash_seed: int = option(0, "seed of the prefix block hash chain (schedulers and routers of one cluster share "
                               "it)")
    step_timeout: float = option(300.0, "seconds one worker step may take: past it the scheduler replaces its "
                                        "worker (a hung device) and the router resumes its requests elsewhere")
    stall_timeout: float = option(30.0, "seconds the scheduler may wait on its worker (a step, a restart) before "
                                        "it reports NOT_SERVING and leaves the registry, until it makes progress "
                                        "again")
    structured_output_compile_timeout: float = option(
        10.0, "seconds a request may wait for its grammar (JSON schema, regex, ...) to compile, counted from when "
              "xgrammar is loaded, and the longest its grammar may take to find the tokens allowed after one; past it "
              "the request fails with INVALID_ARGUMENT (HTTP 400)")
    structured_output_compile_workers: int = option(
        2, "grammars compiled at once, those past the timeout included (a compile cannot be stopped): at most this "
           "many cores compile")
    scheduling_policy: str = option(
        "fcfs", "the order of the work that competes for a step (prefill chunks and admissions; decodes always run): "
                "fcfs, arrival order; priority, a request's priority then arrival (lower first; a better one may "
                "preempt a worse running one when the pool or the batch is full); fair, within a priority band the "
                "tenant served the fewest weighted tokens first (scheduler/scheduling_policy.py)",
        choices=SCHEDULING_POLICIES)
    priority_aging_steps: int = option(
        1000, "under priority and fair, a request's priority improves by one for every this many steps since it "
              "arrived, so that no band waits forever")
    speculative_config: str = option(
        "", "speculative decoding, as a JSON object of vLLM's keys: {\"method\": \"ngram\", "
            "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5, "
            "\"disable_by_batch_size\": null} or {\"method\": \"draft_model\", \"model\": DIR, "
            "\"num_speculative_tokens\": 4} (base/speculative.py); empty: off")
    enable_lora: bool = option(False, "serve LoRA adapters of the model (PEFT's format), batched with the base model "
                                      "and each other in every step", switch_on="--enable-lora")
    lora_modules: list[str] = option([], "adapters to load at start, NAME=PATH (a PEFT directory): a request names "
                                         "one as its model", repeat=True, many=True, metavar="NAME=PATH")
    max_loras: int = option(1, "with --enable-lora, adapters resident on the device at once: a step runs at most "
                               "this many (a request for another waits for a slot)")
    max_lora_rank: int = option(16, "with --enable-lora, the largest rank an adapter may have")
    max_cpu_loras: int = option(0, "with --enable-lora, adapters kept in host memory (the rest are read from disk "
                                   "when they come back); 0: --max-loras")
    tensor_parallel_size: int = option(1, "ranks the model is sharded across, one device each (GPUs of one host; "
                                          "processes sharing the cores on a CPU): a scheduler drives the group as "
                                          "one worker", short="-tp")

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens must not be negative, got {self.max_num_batched_tokens}")
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
        parse_speculative_config(self.speculative_config)
        if self.worker_overlap == "on" and not self.async_scheduling:
            raise ValueError("worker_overlap on needs async scheduling: the next step must be sent while one runs")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be fcfs, priority or fair, got {self.scheduling_policy!r}")
        if self.priority_aging_steps < 1:
            raise ValueError(f"priority_aging_steps must be at least 1, got {self.priority_aging_steps}")
        check_lora_options(self)
        check_tensor_parallel_options(self)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")


def check_tensor_parallel_options(config: EngineConfig) -> None:
    if config.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {config.tensor_parallel_size}")


def check_lora_options(config: EngineConfig) -> None:
    if config.lora_modules and not config.enable_lora:
        raise ValueError("lora_modules needs --enable-lora")
    if config.max_loras < 1 or config.max_lora_rank < 1 or config.max_cpu_loras < 0:
        raise ValueError("max_loras and max_lora_rank must be at least 1, max_cpu_loras at least 0")
    if config.max_cpu_loras and config.max_cpu_loras < config.max_loras:
        raise ValueError(f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras ({config.max_loras})")
    for module in config.lora_modules:
        lora_module(module)


def lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH, as --lora-modules takes it; ValueError naming the flag otherwise."""
    name, sep, path = text.partition("=")
    if not (sep and name.strip() and path.strip()):
        raise ValueError(f"lora_modules: expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def init_request(config: EngineConfig) -> worker_pb2.InitRequest:
    """The worker's part of the config: every InitRequest field is the EngineConfig field of the same name."""
    names = worker_pb2.InitRequest.DESCRIPTOR.fields_by_name
    return worker_pb2.InitRequest(**{name: getattr(config, name) for name in names})
