"""The simulated schedulers' LoRA adapters (`ferry bench cluster --adapters A`): a worker's device slots, and a prefix
cache whose chains start at each request's adapter root.

Slots as the scheduler keeps them (base/config.py `--max-loras`): at most `max_loras` adapters resident at once; a
request's adapter takes a slot when the request is admitted and holds it until the request ends; a new adapter
replaces the least recently used one that no request holds, and where every slot is held the request waits for one
(inside the scheduler: it counts as queued). Making an adapter resident costs `load_s`, added to the scheduler's next
step (the worker loads a step's new slots before its forward: worker.proto `StepRequest.lora_slots`). Every adapter
is loaded on every scheduler (host memory: `--lora-modules` at start), so every scheduler may serve any of them.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from protos.block_hash import next_block_hash
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence

DEFAULT_MAX_LORAS = 4    # 64 adapters over 16 schedulers: 4 each, if routing kept every adapter on one scheduler


@dataclass(frozen=True)
class AdapterSetup:
    """The adapters every simulated scheduler loaded, its device slots, and the seconds one load takes."""
    names: tuple[str, ...]
    max_loras: int = DEFAULT_MAX_LORAS
    load_s: float = 0.0


@dataclass
class AdapterSlots:
    """One worker's device slots: which adapters are resident (least recently used first), and how many admitted
    requests hold each."""
    max_loras: int
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    holders: Counter[str] = field(default_factory=Counter)
    loads: int = 0

    def can_take(self, adapter: str) -> bool:
        """Whether a request for `adapter` can be admitted now: resident, or a slot is free or held by no request."""
        return (adapter in self.resident or len(self.resident) < self.max_loras
                or any(self.holders[name] == 0 for name in self.resident))

    def take(self, adapter: str) -> bool:
        """Hold `adapter` for one more request (can_take said yes); True when it had to be loaded."""
        must_load = adapter not in self.resident
        if must_load:
            if len(self.resident) >= self.max_loras:
                del self.resident[next(name for name in self.resident if self.holders[name] == 0)]
            self.resident[adapter] = None
            self.loads += 1
        self.resident.move_to_end(adapter)
        self.holders[adapter] += 1
        return must_load

    def release(self, adapter: str) -> None:
        self.holders[adapter] -= 1


@dataclass
class AdapterRootedBlockManager(BlockManager):
    """The real block manager, each request's hash chain rooted at its adapter's root (protos.block_hash), so no KV
    is shared across adapters or with the base model: the simulation's stand-in for the scheduler's own adapter
    roots, with `request_roots` (request id -> root) set before each request is added."""
    request_roots: dict[str, int] = field(default_factory=dict)

    def update_hashes(self, seq: Sequence) -> None:
        full = len(seq.token_ids) // self.block_size
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else self.request_roots.get(seq.request_id,
                                                                                          self.root_hash)
            chunk = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            seq.block_hashes.append(next_block_hash(parent, chunk))
