"""Tenants: whose a request is, its weight in fair sharing, the priorities it may ask for and its caps.

A request's tenant is its API key's (a key file line `KEY TENANT`; a key without one is the `default` tenant's).
The `x-ferry-tenant` header names it instead when the caller is trusted: it presented a gateway key (a key file
line `KEY *`), or the router has no API keys at all (anyone may call it anyway). Anyone else naming a tenant is
refused (PERMISSION_DENIED / 403), not silently ignored.

--tenant-config (a JSON object, inline or a file's path) says what each tenant may do; tenants it does not list
get its "default" entry:
  {"tenants": {"search": {"weight": 2, "priority": [0, 10], "max_concurrent_requests": 64,
                          "max_queued_tokens": 200000}},
   "default": {"weight": 1}}
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc

from base.errors import StatusError

TENANT_HEADER = "x-ferry-tenant"
DEFAULT_TENANT = "default"
GATEWAY = "*"
INT32 = (-(2**31), 2**31 - 1)
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass(frozen=True)
class TenantPolicy:
    weight: float = 1.0                      # its share under --scheduling-policy fair and when the router sheds
    priority: tuple[int, int] = INT32        # the priorities its requests may ask for, both ends allowed
    max_concurrent_requests: int = 0        # its streams in flight at this router; 0: no cap
    max_queued_tokens: int = 0              # prompt tokens of its requests still waiting for a first token; 0: none

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"weight must be positive, got {self.weight}")
        low, high = self.priority
        if not INT32[0] <= low <= high <= INT32[1]:
            raise ValueError(f"priority must be [low, high] int32 with low <= high, got {list(self.priority)}")
        if self.max_concurrent_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("max_concurrent_requests and max_queued_tokens must be 0 (no cap) or positive")

    def check_priority(self, tenant: str, priority: int) -> None:
        low, high = self.priority
        if not low <= priority <= high:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"priority {priority} is outside tenant {tenant!r}'s allowed range [{low}, {high}]")


@dataclass(frozen=True)
class Tenant:
    name: str
    policy: TenantPolicy


@dataclass(frozen=True)
class TenantDirectory:
    policies: dict[str, TenantPolicy] = field(default_factory=dict)
    default: TenantPolicy = TenantPolicy()
    key_tenants: dict[str, str] = field(default_factory=dict)   # API key -> its tenant, or GATEWAY
    keys_required: bool = False

    def tenant(self, name: str) -> Tenant:
        return Tenant(name, self.policies.get(name, self.default))

    def resolve(self, api_key: str, header: str) -> Tenant:
        """The caller's tenant: its key's, or the header's where the caller may name one; StatusError if it may
        not, or names none that can be one."""
        own = self.key_tenants.get(api_key, DEFAULT_TENANT)
        trusted = own == GATEWAY or not self.keys_required
        if not header:
            return self.tenant(DEFAULT_TENANT if own == GATEWAY else own)
        if not trusted:
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"{TENANT_HEADER} is accepted only from a gateway key (a key file line 'KEY *')")
        if not TENANT_NAME.fullmatch(header):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{TENANT_HEADER} must be 1-64 letters, digits or ._:- (starting with a letter or "
                              f"digit), got {header[:80]!r}")
        return self.tenant(header)


def tenant_policy(entry: object, where: str) -> TenantPolicy:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    known = {f.name for f in fields(TenantPolicy)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    values = dict(entry)
    if "priority" in values:
        priority = values["priority"]
        if not (isinstance(priority, list) and len(priority) == 2 and all(isinstance(p, int) for p in priority)):
            raise ValueError(f"{where}.priority must be [low, high], two integers")
        values["priority"] = tuple(priority)
    try:
        return TenantPolicy(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def parse_tenant_config(text: str) -> tuple[dict[str, TenantPolicy], TenantPolicy]:
    """--tenant-config's policies by tenant and its default; ValueError naming what is wrong."""
    if not text.strip():
        return {}, TenantPolicy()
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as e:
            raise ValueError(f"--tenant-config: cannot read {text}: {e.strerror}") from e
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--tenant-config is not JSON: {e}") from e
    if not isinstance(config, dict) or set(config) - {"tenants", "default"}:
        raise ValueError('--tenant-config must be an object of "tenants" and "default"')
    tenants = config.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ValueError('--tenant-config "tenants" must be an object of tenant name -> policy')
    for name in tenants:
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(f"--tenant-config: tenant name {name!r} must be 1-64 letters, digits or ._:-")
    policies = {name: tenant_policy(entry, f"tenants.{name}") for name, entry in tenants.items()}
    return policies, tenant_policy(config.get("default", {}), "default")


def tenant_directory(tenant_config: str, key_tenants: dict[str, str], keys_required: bool) -> TenantDirectory:
    policies, default = parse_tenant_config(tenant_config)
    return TenantDirectory(policies, default, key_tenants, keys_required)
