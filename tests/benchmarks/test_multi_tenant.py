"""`ferry bench tenants`: its open-loop schedule, token counting and ratios, one small run end to end, and a run
stopped with SIGTERM."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from benchmarks.services.multi_tenant import Answer, Load, Prompts, flood_summary, open_loop_times, ratios, read_chunk
from tests.deploy.test_cli import processes_with_marker
from tests.services_fixtures import wait_until


def test_an_open_loop_sends_on_schedule_every_request_before_the_duration_ends():
    assert open_loop_times(1.0, 3.0) == [0.0, 1.0, 2.0]
    assert open_loop_times(2.0, 1.2) == [0.0, 0.5, 1.0]
    assert open_loop_times(1.0, 0.5) == [0.0]


def test_prompts_differ_per_request_tenant_and_phase_and_repeat_for_a_seed():
    prompts, load = Prompts(seed=3, vocab_size=800), Load("light", 16, 4)
    first = [prompts.ids(load, n) for n in range(5)]
    assert len({tuple(ids) for ids in first}) == 5 and all(len(ids) == 16 for ids in first)
    assert first == [Prompts(seed=3, vocab_size=800).ids(load, n) for n in range(5)]
    assert prompts.ids(Load("flood", 16, 4), 0) != first[0]
    assert Prompts(seed=3, vocab_size=800, phase="flood_and_light").ids(load, 0) != first[0]
    assert all(100 <= t < 700 for ids in first for t in ids)


def test_tokens_held_back_count_at_the_last_chunk_from_the_usage():
    answer = Answer(sent=0.0)
    for text in ("a", "", "bc"):
        read_chunk({"choices": [{"text": text}]}, answer)
    read_chunk({"choices": [], "usage": {"completion_tokens": 4}}, answer)
    assert len(answer.token_times) == 4 and answer.token_times[-1] == answer.token_times[1]
    read_chunk({"error": {"message": "boom"}}, answer)
    assert "boom" in answer.error


def test_a_flood_counts_cancelled_requests_tokens_but_not_as_answered_or_failed():
    load = Load("flood", 8, 3)
    answers = [Answer(0.0, [0.1, 0.2, 0.3]), Answer(0.3, [0.5]), Answer(0.5), Answer(0.6, error="HTTP 500: x")]
    summary = flood_summary(load, answers, seconds=2.0)
    assert (summary["count"], summary["waiting_at_end"], summary["errors"]) == (1, 1, 1)
    assert (summary["output_tokens"], summary["output_tok_s"]) == (4, 2.0)
    assert summary["ttft_ms"] == {"p50": 200.0, "p90": 200.0}


def test_ratios_compare_each_policy_with_the_loads_alone_and_fair_with_fcfs():
    def phases(light_p90, flood_tok_s, interactive_p90, batch_p90):
        return {"flood_and_light": {"light": {"ttft_ms": {"p90": light_p90}}, "flood": {"output_tok_s": flood_tok_s}},
                "priority_mix": {"interactive": {"ttft_ms": {"p90": interactive_p90}},
                                 "batch": {"ttft_ms": {"p90": batch_p90}}}}
    fcfs = {**phases(400.0, 100.0, 300.0, 300.0), "light_alone": {"light": {"ttft_ms": {"p90": 100.0}}}}
    runs = [{"num_schedulers": 1, "policy": "fcfs", "phases": fcfs},
            {"num_schedulers": 1, "policy": "fair", "phases": phases(150.0, 90.0, 300.0, 300.0)}]
    assert ratios(runs) == {"1": {"light_p90_flooded_over_alone": {"fcfs": 4.0, "fair": 1.5},
                                  "flood_tok_s_fair_over_fcfs": 0.9,
                                  "priority0_p90_over_priority1_p90": {"fcfs": 1.0, "fair": 1.0}}}


def test_tenants_bench_answers_every_phase_of_a_small_served_load(tiny_llama_dir):
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "tenants", "--json", "--model",
                          str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-memory", "4000000", "--policies",
                          "fcfs,fair", "--duration", "2", "--light-rate", "2", "--light-prompt-tokens", "8",
                          "--light-output-tokens", "4", "--flood-streams", "4", "--flood-prompt-tokens", "32",
                          "--flood-output-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    fcfs, fair = result["runs"]
    assert set(fcfs["phases"]) == {"light_alone", "flood_alone", "flood_and_light", "priority_mix"}
    assert set(fair["phases"]) == {"flood_and_light", "priority_mix"} and fair["policy"] == "fair"
    for run in (fcfs, fair):
        for phase in run["phases"].values():
            assert phase.pop("drain_s") >= 0
            cut = phase.pop("interrupted_steps")
            assert cut >= 0 and (run is fair or cut == 0)   # fcfs: nothing ever outranks the work in hand
            for tenant in phase.values():
                assert tenant["count"] > 0 and tenant["errors"] == 0
                assert 0 < tenant["ttft_ms"]["p50"] <= tenant["ttft_ms"]["p90"]
                assert tenant["scheduler_queue_ms_mean"] >= 0   # read off the schedulers' metrics by tenant
    for phase, tenant in [("light_alone", "light"), ("flood_and_light", "light"), ("priority_mix", "interactive")]:
        assert fcfs["phases"][phase][tenant]["sent"] == 4 and fcfs["phases"][phase][tenant]["mean_output_tokens"] == 4
    assert fcfs["phases"]["flood_alone"]["flood"]["output_tok_s"] > 0
    assert fcfs["phases"]["priority_mix"]["batch"]["priority"] == 1
    assert result["ratios"]["1"]["light_p90_flooded_over_alone"]["fair"] > 0
    assert result["ratios"]["1"]["flood_tok_s_fair_over_fcfs"] > 0
    assert result["cpu_model"]


def test_a_benchmark_stopped_with_sigterm_stops_the_stack_it_started(tiny_llama_dir):
    """ferry up runs in a session of its own: without unwinding, a SIGTERM to the bench would leave it running."""
    marker = uuid.uuid4().hex
    bench = subprocess.Popen([sys.executable, "-m", "ferry.cli", "bench", "tenants", "--model", str(tiny_llama_dir),
                              "--dtype", "float32", "--kv-cache-memory", "4000000", "--duration", "60"],
                             env={**os.environ, "FERRY_TEST_MARKER": marker}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(processes_with_marker(marker)) >= 5, "the bench, ferry up and its services",
                   timeout=120)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(90) == 128 + signal.SIGTERM
        wait_until(lambda: not processes_with_marker(marker), "every process of the stack gone", timeout=30,
                   explain=lambda: "left: " + "; ".join(command_line(pid) for pid in processes_with_marker(marker)))
    finally:
        bench.kill()
        for pid in processes_with_marker(marker):   # none, unless the test failed: not left for the next ones
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def command_line(pid: int) -> str:
    try:
        return f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"{pid} (gone)"
