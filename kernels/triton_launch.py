"""What the Triton kernels' Python launchers share: the checks before a launch and the compile-time choices."""
from __future__ import annotations

import math

import torch

from kernels.triton_tiles import HAS_TRITON, attend_tile

LOG2E = 1.4426950408889634   # the kernels' softmax runs in the log2 domain: scores are scaled by scale * LOG2E
NO_WINDOW = 1 << 30          # the kernels' window argument when every query sees its whole context


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the triton attention backend needs the triton package (use the torch backend)")


def interpreting() -> bool:
    """Whether the kernels were built by the interpreter (TRITON_INTERPRET=1 when they were imported)."""
    return type(attend_tile).__name__ == "InterpretedFunction"


def compute_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast after load, tl.dot input precision). fp32 stays exact; 16-bit runs on tensor cores natively."""
    upcast = dtype == torch.float32 or interpreting()
    return upcast, "ieee" if upcast else "tf32"


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same strides and a contiguous head_dim")
