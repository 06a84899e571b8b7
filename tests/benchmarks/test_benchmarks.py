"""`ferry bench` runs end to end on a tiny model and reports what it promises (no timing thresholds)."""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli import BENCHMARKS
from benchmarks.services import grpc_stream_cost
from ferry.launcher import free_port
from tests.services_fixtures import ferry_up

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", *args, "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_benchmark_is_a_module_with_main_run_by_name_only():
    mains = set()
    for path in (ROOT / "benchmarks").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            mains.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
        assert "__main__" not in path.read_text() or path.name == "__main__.py", path
    assert mains == {bench.module for bench in BENCHMARKS.values()} | {"benchmarks.cli"}


def test_ferry_bench_lists_the_benchmarks_and_runs_one_by_name():
    listed = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0 and all(f"    {name}" in listed.stdout for name in BENCHMARKS)
    bounds = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "hit-rate-bounds", "60"],
                            capture_output=True, text=True, timeout=120)
    assert bounds.returncode == 0, bounds.stderr[-2000:]
    assert "'num_requests': 60, 'one_scheduler_per_tenant': 0.648, 'round_robin': 0.542" in bounds.stdout


def test_offline_bench_compares_modes_and_transformers(tiny_llama_dir, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": list(range(5, 5 + n)), "max_tokens": m}
                                    for n, m in [(7, 5), (20, 9), (3, 12), (11, 4)]]))
    result = run_bench("offline", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload-file",
                       str(workload), "--modes", "continuous,static,hf")
    for mode in ("continuous", "static", "hf"):
        assert result["results"][mode]["output_tokens"] == 5 + 9 + 12 + 4
        assert result["results"][mode]["output_tokens_per_s"] > 0
    assert set(result["ratios"]) == {"continuous/hf", "static/hf", "continuous/static"}


def test_offline_bench_steps_by_the_token_budget_it_is_given(tiny_llama_dir, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": list(range(5, 45)), "max_tokens": 2}]))
    result = run_bench("offline", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload-file",
                       str(workload), "--modes", "continuous", "--max-num-batched-tokens", "8")
    assert result["results"]["continuous"]["steps"] == 40 // 8 + 1   # five prompt chunks, then one decode


def test_vllm_offline_bench_outside_a_vllm_venv_says_how_to_make_one():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this Python")
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "vllm-offline", "--workload", "mixed_small"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert "vLLM is not installed in this Python" in out.stderr and "scripts/vllm_cpu_venv.sh" in out.stderr


def test_roofline_bench_counts_a_decode_steps_arithmetic(tiny_llama_dir):
    result = run_bench("roofline", "--model", str(tiny_llama_dir), "--dtype", "float32", "--batch", "3",
                       "--prompt-len", "8", "--steps", "4", "--matmul-size", "256")
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    per_layer = hidden * (hidden + 2 * kv_width) + hidden * hidden + hidden * 2 * inner + inner * hidden
    context = 8 + 1 + 4 // 2
    attention = 4 * config["num_hidden_layers"] * config["num_attention_heads"] * config["head_dim"] * context
    expected = (2 * (config["num_hidden_layers"] * per_layer + hidden * vocab) + attention) * 3 / 1e9
    assert result["dtype"] == "float32" and result["batch"] == 3 and result["context"] == context
    assert result["step_gflop"] == round(expected, 6)
    assert result["peak_gflop_s"] > 0 and result["step_ms"] > 0
    limit_ms = result["step_gflop"] / result["peak_gflop_s"] * 1e3
    assert result["step_over_limit"] == pytest.approx(result["step_ms"] / limit_ms, rel=0.05)


def test_cpu_prefill_bench_times_every_path_on_the_same_chunks_and_they_agree():
    result = run_bench("cpu-prefill", "--chunks", "40,7", "--cached", "9", "--num-heads", "4", "--num-kv-heads", "2",
                       "--head-dim", "32", "--rounds", "2")
    seen = sum(range(9 + 1, 49 + 1)) + sum(range(9 + 1, 16 + 1))
    assert result["gflop"] == round(4 * 4 * 32 * seen / 1e9, 4)
    assert "torch" in result["ms"] and set(result["ms"]) == set(result["gflop_s"])
    assert all(difference < 1e-4 for difference in result["max_abs_difference"].values())
    if "prefill kernel" in result["ms"]:
        assert set(result["prefill kernel speed-up"]) == set(result["ms"]) - {"prefill kernel"}


def test_memory_bench_shows_paged_kv_holding_more_sequences(tiny_llama_dir, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": list(range(5, 45)), "max_tokens": 20}] * 12))
    # tiny model: 2 layers x 2 KV heads x 16 dims x fp32 = 512 bytes per token; room for 4 x 256 tokens
    result = run_bench("memory", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload-file",
                       str(workload), "--kv-cache-memory", str(4 * 256 * 512), "--max-model-len", "256",
                       "--plot-dir", str(tmp_path))
    assert result["contiguous"]["peak_running"] == 4
    assert result["paged"]["peak_running"] == 12
    assert result["paged"]["mean_slot_fill"] > 0.8 > result["contiguous"]["mean_slot_fill"]
    sharing = result["parallel_sampling"]
    assert sharing["blocks_shared"] < sharing["blocks_independent"]
    assert (tmp_path / "kv_occupancy.png").stat().st_size > 0


def test_prefix_bench_reads_hit_counters_from_a_served_stack(tiny_llama_dir, tmp_path):
    workload = tmp_path / "w.json"
    prefix = list(range(5, 5 + 64))   # four full blocks of 16, shared
    workload.write_text(json.dumps([{"prompt_token_ids": prefix + [100 + i, 200 + i], "max_tokens": 3}
                                    for i in range(4)]))
    result = run_bench("prefix", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload-file",
                       str(workload), "--num-prompts", "4", "--request-rate", "inf", "--configs", "single",
                       "--kv-cache-memory", "4000000")
    [run] = result["runs"]
    assert run["serve"]["completed"] == 4 and run["serve"]["output_tokens_per_s"] > 0
    assert run["prefix_cache_queries"] == 4 * 66
    assert 0 <= run["prefix_cache_hits"] <= 3 * 64 and run["hit_rate"] == run["prefix_cache_hits"] / (4 * 66)


def test_serve_bench_drives_an_openai_server_with_guidellms_synthetic_shape(tiny_llama_dir):
    """The served benchmark against the OpenAI API of a running stack, as it would against another engine's."""
    http_port = free_port()
    with ferry_up(["--model", str(tiny_llama_dir), "--dtype", "float32", "--http-port", str(http_port)]):
        result = run_bench("serve", "--backend", "openai", "--target", f"http://127.0.0.1:{http_port}",
                           "--synthetic", "24:5", "--synthetic-vocab", "200", "--num-prompts", "6",
                           "--max-concurrency", "3", "--served-model", tiny_llama_dir.name, "--num-warmups", "4")
    assert result["warmup"] == {"completed": 4, "failed": 0, "errors": []}
    [run] = result["runs"]
    assert run["completed"] == 6 and run["failed"] == 0 and run["peak_concurrency"] == 3
    assert run["output_tokens_per_s"] * run["duration_s"] == pytest.approx(6 * 5)
    assert run["ttft_s"]["p90"] >= run["ttft_s"]["p50"] > 0 and run["itl_s"]["p50"] > 0


def test_serve_warm_up_shares_no_prompt_prefix_with_the_timed_requests():
    from benchmarks.services.serve import synthetic_requests, warmup_requests

    timed = synthetic_requests("24:5", 6, vocab=200)
    warmup = warmup_requests(timed[0], 4, vocab=200)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in warmup] == [(24, 5)] * 4
    assert not {tuple(r.prompt_token_ids[:16]) for r in warmup} & {tuple(r.prompt_token_ids[:16]) for r in timed}


def test_split_bench_measures_served_and_traced_against_offline(tiny_llama_dir, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": list(range(5, 5 + n)), "max_tokens": 6}
                                    for n in (4, 9, 17)]))
    result = run_bench("split", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload-file",
                       str(workload), "--kv-cache-memory", "4000000", "--stream-intervals", "1,4")
    assert result["offline"]["output_tokens"] == 18
    assert result["served"]["completed"] == result["served_traced"]["completed"] == 3
    assert result["spans_received"] >= 3 * 2      # at least a router and a scheduler span per request
    assert set(result["ratios"]) == {"served/offline", "traced/untraced", "served/offline at --stream-interval 4"}
    four = result["served_by_stream_interval"]["4"]
    assert four["completed"] == 3 and four["output_tokens_per_s"] * four["duration_s"] == pytest.approx(18)


def test_async_bench_serves_the_same_requests_with_async_scheduling_on_off_and_overlapped_and_reads_the_workers_time(
        tiny_llama_dir, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": list(range(5, 5 + n)), "max_tokens": 6} for n in (4, 9)]))
    result = run_bench("async", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload-file",
                       str(workload), "--kv-cache-memory", "4000000", "--rounds", "1")
    assert [r["mode"] for r in result["rounds"]] == ["on", "off", "overlap"]
    assert all(r["worker_busy_s"] > 0 and r["worker_idle_s"] >= 0 for r in result["rounds"])
    assert set(result["worker_idle_share"]) == {"on", "off", "overlap"} and result["tok_s_on_over_off"] > 0
    fed = {r["mode"]: r["fed_tokens"] for r in result["rounds"]}
    assert fed["overlap"] > 0 and fed["on"] == fed["off"] == 0


def test_async_bench_stops_naming_the_error_when_requests_fail_instead_of_reporting_zero_tokens(tiny_llama_dir,
                                                                                              tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": [10 ** 6], "max_tokens": 2}]))   # past the tiny vocab
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "async", "--model", str(tiny_llama_dir),
                          "--dtype", "float32", "--workload-file", str(workload), "--kv-cache-memory", "4000000",
                          "--rounds", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "1 of 1 requests failed" in out.stderr and "prompt token ids must lie in" in out.stderr


def test_a_workload_extended_past_its_length_keeps_its_shape_without_shared_prefixes():
    from benchmarks.common.workloads import BenchRequest, extend

    base = [BenchRequest(list(range(start, start + n)), m) for start, n, m in [(1000, 20, 5), (5000, 33, 7)]]
    longer = extend(base, 6)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in longer] == [(20, 5), (33, 7)] * 3
    assert len({tuple(r.prompt_token_ids[:16]) for r in longer}) == 6
    assert all(1000 <= t < 40000 for r in longer for t in r.prompt_token_ids)


def test_grpc_stream_cost_counts_every_message_and_both_sides_cpu():
    result = grpc_stream_cost.measure(streams=8, messages=100, interval=0.001)   # ~0.1 s of CPU each side
    assert result["messages"] == 800
    assert result["server_us_per_message"] > 0 and result["client_us_per_message"] > 0


def test_moe_bench_times_a_mixtral_decode_step_against_a_dense_one_of_the_same_active_parameters():
    result = run_bench("moe", "--hidden-size", "32", "--layers", "1", "--experts", "4", "--top-k", "2",
                       "--expert-size", "16", "--dtype", "float32", "--batch", "4", "--prompt-len", "5",
                       "--repeats", "3")
    assert result["batch"] == 4 and result["dtype"] == "float32"
    assert result["shapes"]["num_experts"] == 4 and result["shapes"]["top_k"] == 2
    router = 32 * 4
    assert result["moe_active_parameters"] - result["dense_active_parameters"] == router
    assert result["moe_step_ms"] > 0 and result["dense_step_ms"] > 0
    assert result["moe_over_dense"] == pytest.approx(result["moe_step_ms"] / result["dense_step_ms"], rel=0.01)


def test_moe_bench_counts_the_active_parameters_of_the_dense_model_it_builds(tmp_path):
    from transformers import AutoModelForCausalLM

    from benchmarks.engine.moe import MoeShapes, save_models
    from benchmarks.engine.roofline import linear_parameters
    shapes = MoeShapes(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                       expert_size=16, vocab_size=64)
    _, dense_dir = save_models(shapes, tmp_path)
    assert linear_parameters(AutoModelForCausalLM.from_pretrained(dense_dir)) == shapes.active_parameters(moe=False)


def test_structured_bench_times_constrained_and_unconstrained_decode_and_the_first_token(tiny_llama_dir):
    result = run_bench("structured", "--model", str(tiny_llama_dir), "--batch", "4", "--prompt-len", "8",
                       "--repeats", "3", "--trials", "1")
    assert result["batch"] == 4 and result["timed_steps"] >= 1
    assert result["constrained_step_ms"] > 0 and result["unconstrained_step_ms"] > 0
    assert result["ttft_cold_schema_ms"] > 0 and result["ttft_cached_schema_ms"] > 0


@pytest.mark.slow
def test_gguf_blocks_bench_times_both_weight_forms_of_the_default_model(monkeypatch, capsys):
    from benchmarks.engine import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "BATCHES", (2,))
    monkeypatch.setattr(gguf_blocks, "STEPS", 2)
    monkeypatch.setenv("FERRY_CPU_GGUF_BLOCKS", "1")   # the bench sets it per engine; restored after the test
    assert gguf_blocks.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("121 linears") and lines[-1].startswith("| 2 |")


def test_lora_bench_runs_adapters_against_the_base_model(tiny_llama_dir):
    result = run_bench("lora", "--model", str(tiny_llama_dir), "--dtype", "float32", "--adapters", "1,3",
                       "--num-requests", "4", "--prompt-len", "6", "--max-tokens", "3", "--rounds", "1")
    assert set(result["output_tokens_per_s"]) == {"base (LoRA off)", "base (LoRA on)", "1 adapters", "3 adapters"}
    assert all(value > 0 for value in result["output_tokens_per_s"].values())
    assert result["ratio_to_base"]["base (LoRA off)"] == 1.0


def test_tp_bench_measures_collectives_and_each_ranks_weights(tiny_llama_dir):
    result = run_bench("tp", "--model", str(tiny_llama_dir), "--dtype", "float32", "--sizes", "1,2",
                       "--num-requests", "2", "--prompt-len", "6", "--max-tokens", "3", "--rounds", "1")
    one, two = result["figures"]["1"], result["figures"]["2"]
    assert one["decode"]["collective_ms_per_step"] == 0 < two["decode"]["collective_ms_per_step"]
    assert two["prefill"]["forward_ms_per_step"] > 0
    whole, ranks = result["memory"]["1"]["rank_weight_bytes"], result["memory"]["2"]["rank_weight_bytes"]
    assert len(whole) == 1 and len(ranks) == 2 and all(rank < 0.6 * whole[0] for rank in ranks)


def test_kv_pull_bench_pulls_every_ranks_share_between_tensor_parallel_groups(tiny_llama_dir):
    result = run_bench("kv-pull", "--model", str(tiny_llama_dir), "--dtype", "float32", "--prompt-len", "49",
                       "--rounds", "1", "--tensor-parallel-size", "2")
    rank_block_bytes = 2 * 2 * 1 * 16 * 16 * 4   # 2 layers, K and V, 1 of 2 KV heads, 16 tokens, 16 dims, fp32
    assert result["pulled_blocks"] == 3 and result["pull_failures"] == 0
    assert result["pulled_bytes"] == 3 * 2 * rank_block_bytes   # both ranks' shares
    assert result["ttft_pulled_s"] > 0 and result["ttft_recomputed_s"] > 0
