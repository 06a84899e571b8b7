"""The scheduler's telemetry in process: no tracing and nothing on the steps without an OTLP endpoint or for
requests the sampler drops, and the periodic stats line."""
from __future__ import annotations

from ferry.launcher import free_port


def test_tracing_is_off_and_steps_carry_nothing_without_an_endpoint(monkeypatch):
    from base.telemetry import TRACING_OFF, setup_tracing
    from protos import scheduler_pb2, worker_pb2
    from scheduler.scheduler_telemetry import SchedulerMetrics, SchedulerTelemetry

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert setup_tracing("ferry-test") is TRACING_OFF and not TRACING_OFF.enabled
    telemetry = SchedulerTelemetry(SchedulerMetrics(scheduler_pb2.StatsResponse, "tiny"))
    telemetry.on_arrival("r", 4, 1)
    step = worker_pb2.StepRequest()
    step.new_seqs.add(seq_id="r/0", token_ids=[1, 2, 3, 4], num_prompt_tokens=4, num_scheduled_tokens=4)
    telemetry.on_step(step)
    assert list(step.traceparents) == [] and telemetry.records["r"].span is None


def test_stats_line_reports_load_kv_usage_and_throughput():
    from protos import scheduler_pb2
    from scheduler.scheduler_telemetry import StatsLogger

    stats = [scheduler_pb2.StatsResponse(num_blocks=100, num_free_blocks=100),
             scheduler_pb2.StatsResponse(num_running=3, num_waiting=2, num_blocks=100, num_free_blocks=75,
                                         prompt_tokens_total=200, generation_tokens_total=50,
                                         prefix_cache_queries=200, prefix_cache_hits=50)]
    times = iter([0.0, 10.0])
    logger = StatsLogger(lambda: stats.pop(0), clock=lambda: next(times))
    assert logger.line() is None                                           # the first reading only sets a baseline
    assert logger.line() == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                             "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")


def test_requests_the_sampler_drops_add_nothing_to_steps(monkeypatch):
    from base.telemetry import setup_tracing
    from protos import scheduler_pb2, worker_pb2
    from scheduler.scheduler_telemetry import SchedulerMetrics, SchedulerTelemetry

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracing = setup_tracing("ferry-test")
    try:
        assert tracing.enabled
        telemetry = SchedulerTelemetry(SchedulerMetrics(scheduler_pb2.StatsResponse, "tiny"), tracing)
        telemetry.on_arrival("r", 4, 1)
        step = worker_pb2.StepRequest()
        step.new_seqs.add(seq_id="r/0", token_ids=[1, 2, 3, 4], num_prompt_tokens=4, num_scheduled_tokens=4)
        telemetry.on_step(step)
        assert list(step.traceparents) == []
    finally:
        tracing.shutdown()
