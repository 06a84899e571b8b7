"""The scheduler's metrics carry the names and types the Kubernetes inference gateway reads (vLLM's), in the
collector and through the text exposition."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from protos import scheduler_pb2
from scheduler.scheduler_telemetry import StatsCollector


def test_scheduler_metrics_carry_the_names_the_inference_gateway_reads():
    stats = scheduler_pb2.StatsResponse(num_running=3, num_waiting=2, num_blocks=200, num_free_blocks=50)
    families = {f.name: f for f in StatsCollector(lambda: stats, "tiny").collect()}
    for prefix in ("ferry", "vllm"):
        gauges = {name: families[f"{prefix}:{name}"] for name in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        assert all(g.type == "gauge" for g in gauges.values())
        assert gauges["num_requests_running"].samples[0].value == 3
        assert gauges["num_requests_waiting"].samples[0].value == 2
        assert gauges["kv_cache_usage_perc"].samples[0].value == 0.75   # a fraction in 0..1, as vLLM's


def test_gateway_gauges_survive_the_text_exposition():
    from scheduler.scheduler_telemetry import SchedulerMetrics

    stats = scheduler_pb2.StatsResponse(num_running=1, num_blocks=10, num_free_blocks=10)
    text = SchedulerMetrics(lambda: stats, "tiny").exposition().decode()
    names = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert {names[n] for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                               "vllm:kv_cache_usage_perc")} == {"gauge"}


def test_lora_requests_info_names_the_running_and_waiting_adapters_as_vllm_does():
    stats = scheduler_pb2.StatsResponse(running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"], max_loras=4)
    families = {f.name: f for f in StatsCollector(lambda: stats, "tiny").collect()}
    for prefix in ("ferry", "vllm"):
        [sample] = families[f"{prefix}:lora_requests_info"].samples
        assert sample.labels == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "c", "max_lora": "4"}
        assert sample.value > 0   # when it was read, as vLLM's
    off = {f.name for f in StatsCollector(lambda: scheduler_pb2.StatsResponse(), "tiny").collect()}
    assert "vllm:lora_requests_info" not in off
