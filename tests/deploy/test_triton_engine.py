"""The whole engine on the Triton attention backend (interpreted on CPU) generates the tokens of the torch backend
and of transformers; without triton installed the backend module still imports and says what to use instead."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from kernels import cpu_decode  # noqa: E402
from tests.conftest import import_interpreted_kernels  # noqa: E402

triton_paged = import_interpreted_kernels()


def test_engine_on_the_triton_backend_generates_the_same_tokens_as_on_torch(tiny_llama_dir, monkeypatch) -> None:
    """The whole model over the Triton kernels (interpreted): chunked prefill, mixed batches, decode."""
    from ferry import Engine, EngineConfig, SamplingParams
    calls = []
    for name in ("paged_attention_decode", "paged_prefill_attention"):
        kernel = getattr(triton_paged, name)
        monkeypatch.setattr(triton_paged, name, lambda *a, kernel=kernel, name=name, **k: calls.append(name)
                            or kernel(*a, **k))
    prompts = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 300, 6], [9, 4], [31, 32, 33, 34, 35, 36, 37]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for name, backend in (("triton", "triton"), ("torch", "torch"), ("torch-without-cpp", "torch")):
        config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4,
                              kv_cache_memory=1 << 20, max_model_len=64, max_num_batched_tokens=8,
                              attention_backend=backend)
        with monkeypatch.context() as patch:
            if name == "torch-without-cpp":
                patch.setattr(cpu_decode, "extension", lambda: None)
            results[name] = [r.token_ids for r in Engine(config).generate(prompts, params)]
    assert results["triton"] == results["torch"] == results["torch-without-cpp"]
    assert {"paged_attention_decode", "paged_prefill_attention"} <= set(calls)


def test_triton_module_imports_without_triton_installed() -> None:
    code = ("import sys; sys.modules['triton'] = None\n"
            "import kernels.triton_paged as t\n"
            "assert not t.HAS_TRITON\n"
            "try:\n    t.store_kv(None, None, None, None, None)\n"
            "except RuntimeError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch backend" in result.stdout


def test_kernels_imported_before_the_interpreter_was_chosen_run_interpreted_after_reimport() -> None:
    """Every kernels.triton_* module is imported afresh, not only the backend's: a sibling left compiled would
    fail on the CPU."""
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import torch, kernels.triton_paged\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "from tests.conftest import import_interpreted_kernels\n"
            "t = import_interpreted_kernels()\n"
            "cache = torch.randn(2, 4, 1, 16)\n"
            "out = t.paged_attention_decode(torch.randn(1, 2, 16), cache, cache.clone(),\n"
            "                               torch.tensor([[1, 0]], dtype=torch.int32),\n"
            "                               torch.tensor([6], dtype=torch.int32), 0.25)\n"
            "print(tuple(out.shape), bool(out.isfinite().all()))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "(1, 2, 16) True"


def test_kernel_benchmark_says_when_there_is_no_gpu(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    from benchmarks.kernels import kernel_bench
    assert kernel_bench.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_local_and_global_layers_on_the_triton_backend_generate_the_tokens_of_transformers(tmp_path) -> None:
    """Gemma 3 (sliding-window layers between global ones), every layer on the interpreted Triton kernels."""
    from ferry import Engine, EngineConfig
    from tests.conftest import transformers_greedy
    from tests.engine.test_model_families import GREEDY, MAX_TOKENS, build_tiny_model
    model_dir, model = build_tiny_model(tmp_path, "gemma3_text")
    prompts = [[17, 230, 41, 99, 5, 311, 64, 150, 7, 8, 9], [3, 4, 5]]
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=4,
                          kv_cache_memory=1 << 20, max_model_len=64, max_num_batched_tokens=8,
                          attention_backend="triton")
    results = Engine(config).generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == transformers_greedy(model, prompts, MAX_TOKENS)
