"""What a scheduler's heartbeat publishes (scheduler/presence.py): its identity with its load and LoRA adapters as
its stats say now."""
from __future__ import annotations

from protos import scheduler_pb2
from protos.registration import SchedulerInfo
from scheduler.presence import current_registration


def test_a_heartbeat_publishes_the_load_and_the_adapters_loaded_and_resident_from_the_stats():
    identity = SchedulerInfo("s0", "10.0.0.1:50061", "m", "/m", 16, 4096, 50_000, hash_seed=7)
    stats = scheduler_pb2.StatsResponse(num_waiting=2, num_running=5, waiting_tokens=300, running_tokens=900,
                                        lora_adapters=["sql", "chat", "math"], resident_lora_adapters=["chat"])
    published = current_registration(identity, stats)
    assert (published.num_waiting, published.num_running, published.waiting_tokens, published.running_tokens) == (
        2, 5, 300, 900)
    assert published.lora_adapters == ["sql", "chat", "math"] and published.resident_lora_adapters == ["chat"]
    assert (published.scheduler_id, published.hash_seed) == ("s0", 7) and identity.lora_adapters == []
