"""Each tenant's load at this router, its caps, and who is shed when the cluster is saturated.

A request is queued from its admission (prompt tokenized) to its first token, and in flight until it ends. A
tenant over its max_concurrent_requests or max_queued_tokens is refused with RESOURCE_EXHAUSTED / 429. The router
is saturated when `shed_queued_requests` of its requests are queued: a new request is then refused if its tenant
already holds its weighted share of the queue (its weight over the weights of the tenants queued, itself included)
or more. The tenants furthest over their share are the ones shed; one under its share is still admitted, so a light
tenant gets through a flood. Counts are this router's own (with several routers, each caps and sheds on its own).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from router.limits import OverLimit
from router.tenants import Tenant


@dataclass
class TenantLoad:
    weight: float = 1.0
    in_flight: int = 0
    queued: int = 0
    queued_tokens: int = 0


@dataclass
class TenantAdmission:
    shed_queued_requests: int = 0
    loads: dict[str, TenantLoad] = field(default_factory=lambda: defaultdict(TenantLoad))

    def ticket(self, tenant: Tenant) -> TenantTicket:
        return TenantTicket(self, tenant)

    @property
    def queued(self) -> int:
        return sum(load.queued for load in self.loads.values())

    def admit(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Count a request of tenant as in flight and queued, or raise OverLimit."""
        policy, load = tenant.policy, self.loads[tenant.name]
        load.weight = policy.weight
        if policy.max_concurrent_requests and load.in_flight >= policy.max_concurrent_requests:
            self.forget_if_idle(tenant.name)
            raise OverLimit(f"tenant {tenant.name!r} is at its limit of {policy.max_concurrent_requests} concurrent "
                            "requests; retry later", 1)
        if policy.max_queued_tokens and load.queued_tokens + prompt_tokens > policy.max_queued_tokens:
            self.forget_if_idle(tenant.name)
            raise OverLimit(f"tenant {tenant.name!r} has {load.queued_tokens} prompt tokens queued; this prompt's "
                            f"{prompt_tokens} would pass its limit of {policy.max_queued_tokens}; retry later", 1)
        self.check_share(tenant.name, load)
        load.in_flight, load.queued, load.queued_tokens = (load.in_flight + 1, load.queued + 1,
                                                           load.queued_tokens + prompt_tokens)

    def check_share(self, tenant: str, load: TenantLoad) -> None:
        queued = self.queued
        if not self.shed_queued_requests or queued < self.shed_queued_requests:
            return
        weights = sum(other.weight for name, other in self.loads.items() if other.queued or name == tenant)
        share = queued * load.weight / weights
        if load.queued >= share:
            self.forget_if_idle(tenant)
            raise OverLimit(f"the cluster is saturated ({queued} requests wait for their first token) and tenant "
                            f"{tenant!r} holds {load.queued} of them, at or over its share of {share:.1f}; retry "
                            "later", 1)

    def started(self, tenant: str, prompt_tokens: int) -> None:
        load = self.loads[tenant]
        load.queued -= 1
        load.queued_tokens -= prompt_tokens

    def release(self, tenant: str) -> None:
        self.loads[tenant].in_flight -= 1
        self.forget_if_idle(tenant)

    def forget_if_idle(self, tenant: str) -> None:
        load = self.loads.get(tenant)
        if load is not None and not load.in_flight:
            del self.loads[tenant]


@dataclass
class TenantTicket:
    """One request's place in its tenant's load: `admit` once the prompt's length is known, `started` at its first
    token, `release` at its end; each step only once, and none before admit."""
    admission: TenantAdmission
    tenant: Tenant
    prompt_tokens: int = 0
    admitted: bool = False
    queued: bool = False

    def admit(self, prompt_tokens: int) -> None:
        self.admission.admit(self.tenant, prompt_tokens)
        self.prompt_tokens, self.admitted, self.queued = prompt_tokens, True, True

    def started(self) -> None:
        if self.queued:
            self.queued = False
            self.admission.started(self.tenant.name, self.prompt_tokens)

    def release(self) -> None:
        self.started()
        if self.admitted:
            self.admitted = False
            self.admission.release(self.tenant.name)
