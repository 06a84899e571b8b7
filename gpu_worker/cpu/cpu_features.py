"""What this CPU can do fast, read once at start: the vector extensions the worker's paths depend on, and the dtype
`--dtype auto` computes in.

bf16 is fast on a CPU only where it multiplies bf16 natively (AVX512-BF16 dot products or AMX tiles). Elsewhere
oneDNN emulates bf16 matmuls by widening every weight on every call, which measured 4x slower than fp32 on an AVX2
EPYC (BENCHMARKS.md, issue 17), so auto picks fp32 there.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuFeatures:
    model: str              # as /proc/cpuinfo names it
    capability: str         # torch's ATen dispatch level: DEFAULT, AVX2, AVX512 ...
    flags: frozenset[str]   # of REPORTED_FLAGS, those present

    @property
    def native_bf16(self) -> bool:
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def auto_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.native_bf16 else torch.float32

    def describe(self) -> str:
        flags = ",".join(flag for flag in REPORTED_FLAGS if flag in self.flags) or "none"
        return f"{self.model} [{flags}] torch {self.capability}"

    def as_labels(self) -> dict[str, str]:
        return {"cpu_model": self.model, "cpu_capability": self.capability,
                "cpu_flags": ",".join(flag for flag in REPORTED_FLAGS if flag in self.flags),
                "native_bf16": str(self.native_bf16).lower()}


@cache
def detect() -> CpuFeatures:
    model, flags = parse_cpuinfo(read_cpuinfo())
    return CpuFeatures(model, torch.backends.cpu.get_cpu_capability(), frozenset(flags) & set(REPORTED_FLAGS))


def read_cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """The first processor's model name and flags ('unknown' and none where the file says nothing)."""
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags
