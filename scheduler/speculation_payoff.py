"""When speculation pays, from what this scheduler measures: its decode steps' time in the worker (inputs, forward,
sampling, proposals) against the tokens they compute, and the share of proposed tokens its model keeps.

A decode step of n tokens takes about T(n) = fixed + per_token * n (the weights are read once a step whatever n is;
each token then costs its share of compute). A batch of B decodes that proposes C tokens, of which a share a is kept,
gains a * C tokens for C more computed: tokens per second rise iff (B + a C) / T(B + C) > B / T(B), which for any C
is B < a / (1 - a) * fixed / per_token. So the break-even batch grows with the acceptance rate (a copy-heavy load
speculates at batch sizes where an open-ended one stops) and with how much of a step is fixed cost (small batches,
small models, memory-bound devices). Both terms are fit over recent steps, so the rule follows the device, the model
and the load; until there is enough to fit, it speculates.
"""
from __future__ import annotations

from collections import deque

WINDOW_STEPS = 256          # decode steps in the time fit
WINDOW_VERIFICATIONS = 512  # verified proposals in the acceptance rate
MIN_STEPS = 16
MIN_PROPOSED = 64


class WindowSums:
    """Sums over the last `size` (x, y) pairs, kept as pairs come and go: what a least-squares line and a ratio
    need, in constant time a pair."""

    def __init__(self, size: int):
        self.pairs: deque[tuple[float, float]] = deque()
        self.size = size
        self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        self.pairs.append((x, y))
        self.shift(x, y, 1)
        if len(self.pairs) > self.size:
            self.shift(*self.pairs.popleft(), -1)

    def shift(self, x: float, y: float, sign: int) -> None:
        self.x += sign * x
        self.y += sign * y
        self.xx += sign * x * x
        self.xy += sign * x * y


class SpeculationPayoff:
    def __init__(self) -> None:
        self.steps = WindowSums(WINDOW_STEPS)               # (tokens, seconds)
        self.verified = WindowSums(WINDOW_VERIFICATIONS)    # (proposed, accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of decodes only (verifications included): prefill chunks' attention would bend the line."""
        if seconds > 0:
            self.steps.add(num_tokens, seconds)

    def observe_verified(self, num_proposed: int, num_accepted: int) -> None:
        self.verified.add(num_proposed, num_accepted)

    def pays_at(self, batch_size: int) -> bool:
        return batch_size < self.break_even_batch()

    def break_even_batch(self) -> float:
        """The batch size past which proposals cost more than they save; infinite until there is enough to fit."""
        rate = self.acceptance_rate()
        line = self.step_time_line()
        if rate is None or line is None:
            return float("inf")
        fixed, per_token = line
        if rate >= 1.0 or per_token <= 0:
            return float("inf")
        return rate / (1.0 - rate) * max(fixed, 0.0) / per_token

    def acceptance_rate(self) -> float | None:
        return self.verified.y / self.verified.x if self.verified.x >= MIN_PROPOSED else None

    def step_time_line(self) -> tuple[float, float] | None:
        """(fixed, per_token) of the least-squares line through the recent steps; None if their sizes do not
        vary enough to fit one."""
        sums, n = self.steps, len(self.steps.pairs)
        if n < MIN_STEPS:
            return None
        spread = sums.xx - sums.x * sums.x / n
        if spread < n:   # token counts within about one of each other: no slope to see
            return None
        per_token = (sums.xy - sums.x * sums.y / n) / spread
        return (sums.y - per_token * sums.x) / n, per_token
