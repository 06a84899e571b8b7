"""The simulated schedulers' LoRA adapters (`ferry bench cluster --adapters A`).

The schedulers are real (scheduler/core.py with --enable-lora): their own slots (`--max-loras`, least recently used
first, never one a running sequence uses), a request waiting in the queue while its adapter has none, and each
adapter's prefixes hashed from its own root. What the simulation adds is the cost: each slot a step loads
(worker.proto `StepRequest.lora_slots`) adds `load_s` to that step. Every adapter is loaded on every scheduler (host
memory: `--lora-modules` at start), so every scheduler may serve any of them.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_LORAS = 4    # 64 adapters over 16 schedulers: 4 each, if routing kept every adapter on one scheduler


@dataclass(frozen=True)
class AdapterSetup:
    """The adapters every simulated scheduler loaded, its device slots, and the seconds one load takes."""
    names: tuple[str, ...]
    max_loras: int = DEFAULT_MAX_LORAS
    load_s: float = 0.0
