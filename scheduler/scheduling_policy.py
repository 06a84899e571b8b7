"""The order of the work that competes for a step, and whom the pool takes back from when it runs dry
(--scheduling-policy). Decodes run first and are never reordered: what competes is the step's remaining budget,
between running prefills and waiting sequences (but for a newcomer that outranks them, below).

- fcfs: running prefills, then the queue in arrival order (a preempted sequence at its front); the newest running
  sequence is preempted.
- priority (vLLM's): by effective priority, then arrival; the worst running sequence is preempted, and a waiting one
  may preempt a running one of a worse effective priority to be admitted.
- fair (a virtual token counter, Sheng et al., OSDI 2024): within an effective priority band, the tenant that was
  served the fewest tokens divided by its weight first. Every position a tenant's sequences compute for the first
  time counts (prompt and output; a recompute after preemption does not, a cached prefix is free). A tenant that
  becomes active starts one step's budget behind the least-served active tenant, so idle time banks no more credit
  than that: its first prompt goes before everyone else's work, then it shares. Preemption takes from the lowest
  band, most-served tenant first; a waiting sequence may preempt a running one of a worse band, or of its band and
  a tenant served more by over one step's budget (the margin keeps two tenants from preempting each other back
  and forth).

A step that gives prompt tokens to a sequence gives none to those it may preempt (priority: of a worse band; fair:
also of its band and a tenant served more by over a step's budget), and a step that admits a newcomer runs none of
their decodes either: a newcomer that outranks the work in hand gets a step of its own prompt and the decodes it
does not outrank, the shortest wait for its first token, and what it kept out runs the next step (under fair, a
tenant far behind the others; a tenant level with them shares their steps). While the requests in the scheduler
are of more than one band or tenant (`contended`), the service builds each step once the last one's result is in
rather than while it runs, where that costs the worker little (scheduler/engine_loop.py): an arrival ranked first
then joins the next step instead of the one after.

Aging, so that no band waits forever: a request's effective priority is its priority less one for every
`priority_aging_steps` steps since it arrived. A request of priority p behind a stream of newer requests of
priority q < p is served after at most (p - q + 1) x priority_aging_steps steps.
"""
from __future__ import annotations

from collections import Counter

from scheduler.sequence import Sequence, Tenancy


class FirstComeFirstServed:
    def __init__(self, aging_steps: int = 1, step_budget: int = 0):
        self.aging_steps = aging_steps
        self.step_budget = step_budget

    def order(self, prefills: list[Sequence], waiting: list[Sequence], step: int) -> list[Sequence]:
        return [*prefills, *waiting]

    def victim(self, running: list[Sequence], step: int) -> Sequence:
        return max(running, key=lambda s: s.arrival)

    def may_preempt_for(self, seq: Sequence, victim: Sequence, step: int) -> bool:
        return False

    def on_arrival(self, tenancy: Tenancy) -> None:
        pass

    def on_departure(self, tenancy: Tenancy) -> None:
        pass

    def charge(self, seq: Sequence) -> None:
        pass

    def contended(self) -> bool:
        """Whether an arrival may be ranked ahead of the work in hand."""
        return False


class PriorityFirst(FirstComeFirstServed):
    def __init__(self, aging_steps: int = 1, step_budget: int = 0):
        super().__init__(aging_steps, step_budget)
        self.active_priorities: Counter[int] = Counter()   # unfinished requests, by priority

    def on_arrival(self, tenancy: Tenancy) -> None:
        self.active_priorities[tenancy.priority] += 1

    def on_departure(self, tenancy: Tenancy) -> None:
        self.active_priorities[tenancy.priority] -= 1
        if self.active_priorities[tenancy.priority] <= 0:
            del self.active_priorities[tenancy.priority]

    def contended(self) -> bool:
        return len(self.active_priorities) > 1

    def band(self, seq: Sequence, step: int) -> int:
        """seq's effective priority: its priority, improved by one every aging_steps steps since it arrived."""
        return seq.tenancy.priority - (step - seq.arrival_step) // self.aging_steps

    def rank(self, seq: Sequence, step: int) -> tuple:
        return self.band(seq, step), seq.arrival

    def order(self, prefills: list[Sequence], waiting: list[Sequence], step: int) -> list[Sequence]:
        return sorted([*prefills, *waiting], key=lambda s: self.rank(s, step))

    def victim(self, running: list[Sequence], step: int) -> Sequence:
        return max(running, key=lambda s: self.rank(s, step))

    def may_preempt_for(self, seq: Sequence, victim: Sequence, step: int) -> bool:
        return self.band(victim, step) > self.band(seq, step)


class FairShare(PriorityFirst):
    def __init__(self, aging_steps: int = 1, step_budget: int = 0):
        super().__init__(aging_steps, step_budget)
        self.served: dict[str, float] = {}     # tokens served / weight, by tenant
        self.active: Counter[str] = Counter()   # unfinished requests, by tenant

    def rank(self, seq: Sequence, step: int) -> tuple:
        return self.band(seq, step), self.served.get(seq.tenancy.tenant, 0.0), seq.arrival

    def may_preempt_for(self, seq: Sequence, victim: Sequence, step: int) -> bool:
        (victim_band, victim_served, _), (band, served, _) = self.rank(victim, step), self.rank(seq, step)
        if victim_band != band or victim.tenancy.tenant == seq.tenancy.tenant:
            return victim_band > band
        return victim_served > served + self.step_budget

    def contended(self) -> bool:
        return len(self.active) > 1 or super().contended()

    def on_arrival(self, tenancy: Tenancy) -> None:
        super().on_arrival(tenancy)
        tenant = tenancy.tenant
        if not self.active[tenant]:
            lifted = self.return_level() if self.active else 0.0
            self.served[tenant] = max(self.served.get(tenant, 0.0), lifted)
        self.active[tenant] += 1

    def on_departure(self, tenancy: Tenancy) -> None:
        super().on_departure(tenancy)
        tenant = tenancy.tenant
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]
            self.forget_idle()

    def return_level(self) -> float:
        """Where a tenant back from idle starts: just past may_preempt_for's margin behind the least-served active
        tenant, so that its first prompt goes first (infinite with none active)."""
        return min((self.served[t] for t in self.active), default=float("inf")) - self.step_budget - 1

    def forget_idle(self) -> None:
        """Drop idle tenants that a return would lift anyway (all, when none is active): the counters stay as many
        as the tenants served lately."""
        floor = self.return_level()
        for tenant in [t for t, served in self.served.items() if t not in self.active and served <= floor]:
            del self.served[tenant]

    def charge(self, seq: Sequence) -> None:
        """seq's tenant is served the positions it computes for the first time."""
        new = seq.num_computed_tokens - seq.num_charged_tokens
        if new > 0:
            seq.num_charged_tokens = seq.num_computed_tokens
            tenant = seq.tenancy.tenant
            self.served[tenant] = self.served.get(tenant, 0.0) + new / seq.tenancy.weight


POLICIES = {"fcfs": FirstComeFirstServed, "priority": PriorityFirst, "fair": FairShare}


def scheduling_policy(name: str, aging_steps: int, step_budget: int) -> FirstComeFirstServed:
    return POLICIES[name](aging_steps, step_budget)
