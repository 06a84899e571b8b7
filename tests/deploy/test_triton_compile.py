"""The Triton kernels compile ahead of time for an H100 (sm_90) on a machine without a GPU: what the interpreter
cannot check (tl.dot on tensor cores, the helpers Triton inlines, shapes fixed at compile time) still builds."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

BF16_POINTERS = {"out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "key_ptr", "value_ptr", "x_ptr", "w_ptr"}
INT_POINTERS = {"block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr", "seg_starts_ptr", "seg_lengths_ptr",
                "seg_slots_ptr"}


def _signature(kernel, constexprs: dict, pointers: dict[str, str]) -> dict[str, str]:
    """bf16 tensors and pool, int32 tables, int64 slots, fp32 partials and scale, int32 sizes and strides; `pointers`
    overrides a pointer's type."""
    def type_of(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in pointers:
            return pointers[name]
        if name in BF16_POINTERS:
            return "*bf16"
        if name in INT_POINTERS:
            return "*i32"
        if name in ("slot_mapping_ptr", "order_ptr"):
            return "*i64"
        return "*fp32" if name.endswith("_ptr") else "fp32" if name == "qk_scale" else "i32"
    return {name: type_of(name) for name in kernel.arg_names}


def compile_for_hopper() -> dict[str, int]:
    """Each kernel, at the shapes a bf16 Llama with head_dim 128 and 4 query heads per KV head launches (LoRA: full
    row tiles, rank 64) → the size of its cubin. Run where TRITON_INTERPRET is unset (the kernels must be Triton's
    compiled functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_decode, triton_lora, triton_paged, triton_prefill
    attention = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, UPCAST=False, DOT_PRECISION="tf32")
    decode = dict(attention, GROUP_PAD=16, PARTITION_SIZE=512)
    lora = dict(BLOCK_M=64, UPCAST=False, DOT_PRECISION="tf32")
    kernels = {
        "store_kv": (triton_paged._store_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128)),
        "decode": (triton_decode._decode_kernel, dict(decode, SINGLE_PARTITION=True)),
        "decode_partitioned": (triton_decode._decode_kernel, dict(decode, SINGLE_PARTITION=False)),
        "merge": (triton_decode._merge_partitions_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_P=8)),
        "prefill": (triton_prefill._prefill_kernel, dict(attention, GROUP_PAD=4, BLOCK_Q=16)),
        "lora_shrink": (triton_lora._segment_matmul_kernel, dict(lora, SHRINK=True, BLOCK_N=64, BLOCK_K=64)),
        "lora_expand": (triton_lora._segment_matmul_kernel, dict(lora, SHRINK=False, BLOCK_N=64, BLOCK_K=64)),
    }
    fp32_buffer = {"lora_shrink": {"out_ptr": "*fp32"}, "lora_expand": {"x_ptr": "*fp32"}}
    sizes = {}
    for name, (kernel, constexprs) in kernels.items():
        source = ASTSource(kernel, _signature(kernel, constexprs, fp32_buffer.get(name, {})), constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        sizes[name] = len(compiled.asm["cubin"])
    return sizes


def test_every_kernel_compiles_for_hopper_without_a_gpu(tmp_path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, not read from an earlier run's cache
    code = "from tests.deploy.test_triton_compile import compile_for_hopper; print(compile_for_hopper())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    sizes = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert set(sizes) == {"store_kv", "decode", "decode_partitioned", "merge", "prefill", "lora_shrink", "lora_expand"}
    assert all(size > 0 for size in sizes.values())
