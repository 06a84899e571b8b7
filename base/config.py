"""Engine configuration: one dataclass with defaults; each component reads the fields it knows."""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
DRAIN_TIMEOUT_S = 30.0   # on SIGTERM, how long the router and the schedulers let in-flight requests finish


@dataclass
class EngineConfig:
    model: str = ""                       # local HF directory; "" = the default model (SmolLM2-135M-Instruct)
    dtype: str = "auto"                   # float32 | bfloat16 | float16 | auto (gpu_worker.worker.resolve_dtype)
    device: str = "auto"                  # cpu | cuda | auto
    block_size: int = 16
    kv_cache_memory: int = 0              # bytes for the KV pool; 0 = 1 GiB on CPU, 90% of free memory on CUDA
    max_model_len: int = 0                # 0 = min(model's max_position_embeddings, 8192)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    batching: str = "continuous"          # continuous | static (benchmark baseline)
    kv_layout: str = "paged"              # paged | contiguous (benchmark baseline)
    attention_backend: str = "auto"       # auto | torch | triton
    seed: int = 0
    hash_seed: int = 0                    # seed of the prefix block hash chain

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
