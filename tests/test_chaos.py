"""The chaos suite, small: one `ferry up` of a tiny model under streaming load through a SIGKILLed worker, a
SIGKILLed scheduler, a query of death, a SIGSTOPped scheduler, a SIGKILLed Redis and a stopped one. In each, a live scheduler
remained: no request may fail, hang or answer differently than undisturbed, and the stack serves again with every
KV block free (`ferry bench chaos` is the full one, its table in BENCHMARKS.md)."""
from __future__ import annotations

from benchmarks import chaos


def test_the_stack_loses_no_request_through_every_fault_and_recovers(tiny_llama_dir):
    rows = chaos.run(str(tiny_llama_dir), chaos.scenarios(stop_s=3.0, redis_down_s=3.0), clients=6, max_tokens=48,
                     warm_s=1.5, tail_s=1.5, deadline_s=60.0,
                     up_flags=("--dtype", "float32", "--kv-cache-memory", "4000000", "--heartbeat-ttl", "2",
                               "--scheduler-keepalive", "1"))
    print(*rows, sep="\n")
    for row in rows:
        assert row["requests"] > 0 and row["done"] == row["requests"], row
        assert row["wrong"] == 0 and row["hung"] == 0, row
        assert row["recover_s"] >= 0 and row["kv_back_to_0"], row
    assert [row.get("poisoned_request") for row in rows if "poisoned_request" in row] == ["INTERNAL"]   # alone
