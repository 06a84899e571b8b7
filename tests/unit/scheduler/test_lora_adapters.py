"""The scheduler's LoRA adapters: which may join a batch, device slots given least recently used first (never one
a running sequence needs), unloading that waits for the requests using an adapter."""
from __future__ import annotations

import pytest

from scheduler.lora_adapters import AdapterNotFound, LoraAdapters


def adapters(max_loras: int = 2, *names: str) -> LoraAdapters:
    return LoraAdapters(max_loras, enabled=True, loaded={name: f"/adapters/{name}" for name in names})


def test_a_batch_runs_at_most_max_loras_adapters_and_the_base_model_always_joins():
    lora = adapters(2, "a", "b", "c")
    assert lora.may_join("c", {"a"}) and lora.may_join("a", {"a", "b"})
    assert not lora.may_join("c", {"a", "b"})
    assert lora.may_join("", {"a", "b"})


def test_slots_go_to_the_least_recently_used_adapter_the_batch_does_not_need():
    lora = adapters(2, "a", "b", "c")
    assert [(s.slot, s.name) for s in lora.place(["a", "b"], step=1)] == [(0, "a"), (1, "b")]
    assert lora.place(["a", "b", ""], step=2) == []          # resident: nothing to load
    lora.place(["b"], step=3)                                # a was used last at step 2
    assert [(s.slot, s.name) for s in lora.place(["b", "c"], step=4)] == [(0, "c")]
    assert lora.resident == ["c", "b"]


def test_an_unloaded_adapter_is_refused_to_new_requests_but_kept_for_running_ones():
    lora = adapters(2, "a")
    lora.place(["a"], step=1)
    lora.unload("a", in_use=True)
    with pytest.raises(AdapterNotFound, match="'a'"):
        lora.check_requested("a")
    lora.check_known("a")                                    # a request already running with it rejoins
    assert lora.take_unloaded() == [] and lora.resident == ["a"]
    lora.retire(in_use={"a"})
    assert lora.take_unloaded() == []
    lora.retire(in_use=set())
    assert lora.take_unloaded() == ["a"] and lora.resident == [] and not lora.retiring


def test_unloading_an_adapter_not_loaded_says_so():
    with pytest.raises(AdapterNotFound, match="'x' is not loaded"):
        adapters(1).unload("x", in_use=False)


def test_with_lora_off_a_request_naming_an_adapter_is_told_so():
    with pytest.raises(AdapterNotFound, match="--enable-lora"):
        LoraAdapters(1).check_requested("a")
