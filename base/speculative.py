"""--speculative-config: vLLM's JSON keys, parsed and checked once.

A method proposes up to num_speculative_tokens tokens after a sequence's last one; the target model computes them
all in one step and keeps the longest run it would have sampled itself (scheduler/speculation.py). "ngram" looks
the proposal up in the sequence's own tokens (prompt lookup), in the scheduler. "draft_model" runs a smaller model
with the same vocabulary in the worker (gpu_worker/draft_model.py), which hands its proposals back with the step's
result; an EAGLE-style head would be a third method of that kind.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    model: str = ""                     # draft_model: its local directory (safetensors + config)
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2          # the shortest suffix of the sequence looked up
    prompt_lookup_max: int = 5          # the longest (tried first)
    # no proposals while this many sequences or more run, and proposals below it; None (the default): proposals
    # where this scheduler's measurements say they pay (scheduler/speculation_payoff.py)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not supported (supported: "
                             f"{', '.join(METHODS)})")
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError("speculative_config.model: a draft_model needs one, and only a draft_model takes one")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be at least 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be at least 1 (or null: measured)")


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The config a --speculative-config JSON object gives; None for an empty one (speculation off)."""
    if not text:
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config is not JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError("speculative_config must be a JSON object")
    known = {f.name: f.type for f in fields(SpeculativeConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
    if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
        values["prompt_lookup_min"] = min(values["prompt_lookup_max"], SpeculativeConfig.prompt_lookup_min)
    for name, value in values.items():
        if name in ("method", "model"):
            if not isinstance(value, str):
                raise ValueError(f"speculative_config.{name} must be a string, got {value!r}")
        elif (not isinstance(value, int) or isinstance(value, bool)) and not (
                name == "disable_by_batch_size" and value is None):
            raise ValueError(f"speculative_config.{name} must be an integer, got {value!r}")
    return SpeculativeConfig(**values)

