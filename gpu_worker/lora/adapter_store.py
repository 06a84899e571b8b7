"""The adapters a worker may run: each checked once when loaded, its weights kept in host memory up to
--max-cpu-loras (least recently used first out; one evicted is read from its directory again when needed)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from gpu_worker.lora.peft_adapter import LoraWeights


class AdapterStore:
    def __init__(self, read: Callable[[str, str], LoraWeights], max_cpu_loras: int):
        self.read = read                      # (name, path) -> checked weights; AdapterRefused otherwise
        self.max_cpu_loras = max_cpu_loras
        self.paths: dict[str, str] = {}
        self.in_memory: OrderedDict[str, LoraWeights] = OrderedDict()

    def load(self, name: str, path: str) -> LoraWeights:
        """Read and check the adapter; from now on `get(name)` gives it. A name loaded already is read again."""
        weights = self.read(name, str(Path(path)))
        self.paths[name] = path
        self.keep(name, weights)
        return weights

    def get(self, name: str) -> LoraWeights:
        if name in self.in_memory:
            self.in_memory.move_to_end(name)
            return self.in_memory[name]
        if name not in self.paths:
            raise KeyError(f"LoRA adapter {name!r} is not loaded in this worker")
        weights = self.read(name, self.paths[name])
        self.keep(name, weights)
        return weights

    def unload(self, name: str) -> None:
        self.paths.pop(name, None)
        self.in_memory.pop(name, None)

    def keep(self, name: str, weights: LoraWeights) -> None:
        self.in_memory[name] = weights
        self.in_memory.move_to_end(name)
        while len(self.in_memory) > self.max_cpu_loras:
            self.in_memory.popitem(last=False)
