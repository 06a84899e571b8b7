"""What the worker reads of the CPU, and the dtype `--dtype auto` picks from it."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.cpu import cpu_features
from gpu_worker.cpu.cpu_features import CpuFeatures, parse_cpuinfo
from gpu_worker.worker import resolve_dtype
from kernels import cpu_decode, cpu_layers

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2
"""
XEON_BF16 = """model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile
"""


def features(text: str) -> CpuFeatures:
    model, flags = parse_cpuinfo(text)
    return CpuFeatures(model, "AVX2", frozenset(flags) & set(cpu_features.REPORTED_FLAGS))


def test_an_avx2_cpu_computes_in_float32_by_default():
    cpu = features(EPYC_AVX2)
    assert cpu.model == "AMD EPYC 7B13"
    assert cpu.flags == {"avx2", "fma", "f16c"}
    assert not cpu.native_bf16 and cpu.auto_dtype == torch.float32


def test_a_cpu_with_bf16_dot_products_computes_in_bfloat16_by_default():
    cpu = features(XEON_BF16)
    assert cpu.native_bf16 and cpu.auto_dtype == torch.bfloat16
    assert cpu.as_labels()["cpu_flags"] == "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512_bf16,amx_bf16"


def test_an_unreadable_cpuinfo_means_no_vector_flags():
    assert parse_cpuinfo("") == ("unknown", set())


def test_auto_dtype_on_this_cpu_follows_its_flags():
    expected = torch.bfloat16 if cpu_features.detect().native_bf16 else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        resolve_dtype("float16", torch.device("cpu"))


@pytest.mark.skipif(cpu_layers.extension() is None, reason="no C++ compiler for the CPU kernels")
def test_the_kernels_build_the_vector_path_this_cpu_has_and_a_portable_one_on_request():
    flags = cpu_features.detect().flags
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    else:
        expected = "portable"
    assert cpu_layers.extension().vector_isa() == expected
    assert cpu_decode.extension().vector_isa() == expected
    assert cpu_layers.extension(portable=True).vector_isa() == "portable"
