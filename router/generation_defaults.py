"""Sampling defaults from the model's creator, as vLLM applies them (`--generation-config auto`, its default): the
model's generation_config.json gives temperature, top_p, top_k, min_p and repetition_penalty to the requests that
leave them unset, and its max_new_tokens caps max_tokens (Qwen3's, say: temperature 0.6, top_p 0.95, top_k 20).
`--generation-config vllm` leaves them out (the API's own defaults), a folder reads its generation_config.json
instead, and `--override-generation-config` JSON overrides or adds to what was read."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from base.sampling_params import SamplingParams
from protos import common_pb2

# generation_config.json's keys vLLM reads as defaults, each the sampling field of the same name
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_TOKENS_KEY = "max_new_tokens"


@dataclass(frozen=True)
class GenerationConfig:
    """The router's --generation-config and --override-generation-config."""
    source: str = "auto"        # auto: each model's own folder; vllm: none; else a folder
    overrides: str = ""         # JSON object

    def check(self) -> None:
        """ValueError naming the flag when it is wrong (before serving)."""
        if self.source not in ("auto", "vllm") and not (Path(self.source) / "generation_config.json").is_file():
            raise ValueError(f"--generation-config: {self.source} is 'auto', 'vllm' or a folder holding a "
                             "generation_config.json")
        parsed_overrides(self.overrides)

    def defaults(self, model_path: str) -> dict[str, float | int]:
        """The defaults for a model's requests, by generation_config.json key."""
        folder = model_path if self.source == "auto" else "" if self.source == "vllm" else self.source
        found = read_defaults(folder) if folder else {}
        return {**found, **self.parsed_overrides}

    @cached_property
    def parsed_overrides(self) -> dict[str, float | int]:
        """Parsed once, not on every request."""
        return parsed_overrides(self.overrides)


def parsed_overrides(text: str) -> dict[str, float | int]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config: not valid JSON ({e})") from e
    if not isinstance(value, dict) or not set(value) <= {*SAMPLING_KEYS, MAX_TOKENS_KEY}:
        raise ValueError(f"--override-generation-config: a JSON object of "
                         f"{', '.join(sorted({*SAMPLING_KEYS, MAX_TOKENS_KEY}))}")
    return value


_reading = threading.Lock()


def read_defaults(folder: str) -> dict[str, float | int]:
    with _reading:
        return cached_defaults(folder)


@lru_cache(maxsize=8)
def cached_defaults(folder: str) -> dict[str, float | int]:
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return {key: config[key] for key in (*SAMPLING_KEYS, MAX_TOKENS_KEY) if config.get(key) is not None}


def apply_defaults(sampling: common_pb2.SamplingParams, defaults: dict[str, float | int]) -> None:
    """Fill the fields a request left unset; cap max_tokens by max_new_tokens (vLLM caps even a request's own)."""
    for key in SAMPLING_KEYS:
        if key in defaults and not sampling.HasField(key):
            setattr(sampling, key, defaults[key] if key != "top_k" or defaults[key] > 0 else -1)   # 0: off
    if MAX_TOKENS_KEY in defaults:
        asked = sampling.max_tokens if sampling.HasField("max_tokens") else SamplingParams().max_tokens
        sampling.max_tokens = min(asked, int(defaults[MAX_TOKENS_KEY]))
