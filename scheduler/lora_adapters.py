"""The LoRA adapters a scheduler serves, and which of them its worker holds in device slots.

A request names a loaded adapter (or none: the base model). A step runs at most --max-loras adapters, so a
sequence joins the running batch only if its adapter is one the batch runs already or a slot is left for it;
otherwise it waits (others behind it may go), as in vLLM. Slots are given least recently used first; the
adapter a running sequence uses is never taken out of its slot. A sequence that has waited SLOT_WAIT_STEPS steps
for a slot stops admissions behind it until it has one, so a busy adapter cannot keep another out for ever (the
batch drains, a slot frees). An adapter unloaded while requests use it
retires: no new request may name it, and the worker forgets it (StepRequest.unloaded_lora_adapters) once the last
of those has ended."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from protos import worker_pb2


SLOT_WAIT_STEPS = 256   # steps a sequence may wait for an adapter slot before admissions stop for it


class AdapterNotFound(LookupError):
    """A request names an adapter that is not loaded here (gRPC NOT_FOUND, HTTP 404)."""


@dataclass
class LoraAdapters:
    max_loras: int
    enabled: bool = False
    loaded: dict[str, str] = field(default_factory=dict)     # name -> directory
    retiring: dict[str, str] = field(default_factory=dict)   # unloaded, still used by live requests

    def __post_init__(self) -> None:
        self.slots: list[str | None] = [None] * self.max_loras
        self.last_used: dict[str, int] = {}                   # resident adapter -> the last step that ran it
        self.unloaded: list[str] = []                         # for the worker to forget with the next step
        self.waiting_since: dict[str, int] = {}               # seq_id -> the step it first found no slot

    def check_requested(self, name: str) -> None:
        """AdapterNotFound unless a new request may name this adapter."""
        if name and name not in self.loaded:
            raise AdapterNotFound(f"LoRA adapter {name!r} is not loaded" if self.enabled
                                  else f"model {name!r}: LoRA adapters are off (--enable-lora)")

    def check_known(self, name: str) -> None:
        """AdapterNotFound unless the worker has this adapter (a retiring one too: its requests go on)."""
        if name not in self.retiring:
            self.check_requested(name)

    @property
    def resident(self) -> list[str]:
        return [name for name in self.slots if name is not None]

    def may_join(self, name: str, batch_adapters: set[str]) -> bool:
        """Whether a sequence of adapter name may join a batch running batch_adapters (the base model always may)."""
        return not name or name in batch_adapters or len(batch_adapters) < self.max_loras

    def waited_too_long(self, seq_id: str, step: int) -> bool:
        """seq_id found no slot at this step: whether it has been waiting SLOT_WAIT_STEPS steps or more."""
        return step - self.waiting_since.setdefault(seq_id, step) >= SLOT_WAIT_STEPS

    def stop_waiting(self, seq_id: str) -> None:
        """seq_id has its slot, or has left."""
        self.waiting_since.pop(seq_id, None)

    def place(self, needed: Iterable[str], step: int) -> list[worker_pb2.AdapterSlot]:
        """Slots for the adapters a step's running batch uses (at most max_loras of them): the loads the worker
        makes before that step."""
        needed = {name for name in needed if name}
        loads = []
        for name in sorted(needed - set(self.resident)):
            slot = self.free_slot(needed)
            if self.slots[slot] is not None:
                self.last_used.pop(self.slots[slot], None)
            self.slots[slot] = name
            loads.append(worker_pb2.AdapterSlot(slot=slot, name=name))
        for name in needed:
            self.last_used[name] = step
        return loads

    def free_slot(self, needed: set[str]) -> int:
        empty = [slot for slot, name in enumerate(self.slots) if name is None]
        if empty:
            return empty[0]
        evictable = [slot for slot, name in enumerate(self.slots) if name not in needed]
        return min(evictable, key=lambda slot: self.last_used.get(self.slots[slot], -1))

    def unload(self, name: str, in_use: bool) -> None:
        """No new request may name it; the worker forgets it now, or once the requests using it have ended."""
        if name not in self.loaded:
            raise AdapterNotFound(f"LoRA adapter {name!r} is not loaded")
        path = self.loaded.pop(name)
        if in_use:
            self.retiring[name] = path
        else:
            self.forget(name)

    def retire(self, in_use: set[str]) -> None:
        """Retiring adapters no live request uses any more are forgotten."""
        for name in [name for name in self.retiring if name not in in_use]:
            del self.retiring[name]
            self.forget(name)

    def forget(self, name: str) -> None:
        if name in self.slots:
            self.slots[self.slots.index(name)] = None
        self.last_used.pop(name, None)
        self.unloaded.append(name)

    def take_unloaded(self) -> list[str]:
        unloaded, self.unloaded = self.unloaded, []
        return unloaded

    def carried_over(self) -> LoraAdapters:
        """The adapters a new worker must load (retiring ones too), none of them in its slots yet."""
        return LoraAdapters(self.max_loras, self.enabled, dict(self.loaded), dict(self.retiring))
