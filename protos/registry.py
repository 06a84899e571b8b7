"""The Redis registry, part of the contract: what schedulers publish and routers read, and under which keys.

Key scheme (every key starts with the prefix, default "ferry"):
  <prefix>:scheduler:<scheduler_id>   string, JSON of SchedulerInfo (address, model, model_path, block_size,
                                      max_model_len, vocab_size, hash_seed and load: waiting/running requests
                                      and tokens), SET with EX=ttl on every heartbeat; a dead scheduler's key
                                      expires on its own.
  <prefix>:blk:<model>:<hash>         set of scheduler ids holding the KV block whose chained hash
                                      (protos.block_hash) is <hash> (decimal u64): SADD on store, SREM on
                                      evict; with --announce-prompts also SADD when a prompt needing it is
                                      admitted, SREM when that prompt leaves before computing it.
Redis accelerates routing and is never needed for correctness. The publishing side is scheduler/registry.py;
the reading side router/discovery.py.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

KEY_PREFIX = "ferry"


@dataclass
class SchedulerInfo:
    scheduler_id: str
    address: str
    model: str
    model_path: str
    block_size: int
    max_model_len: int
    vocab_size: int
    hash_seed: int = 0
    num_waiting: int = 0
    num_running: int = 0
    waiting_tokens: int = 0
    running_tokens: int = 0

    @property
    def load_tokens(self) -> int:
        return self.waiting_tokens + self.running_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> SchedulerInfo:
        fields = json.loads(text)
        return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})


def scheduler_key(scheduler_id: str, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:scheduler:{scheduler_id}"


def scheduler_key_pattern(prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:scheduler:*"


def block_key(model: str, block_hash: int, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:blk:{model}:{block_hash}"
