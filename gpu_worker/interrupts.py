"""Steps cut short between two layers. On a CPU a step takes tens of milliseconds; a request that outranks its work
(a higher priority, a tenant served less: scheduler/scheduling_policy.py) would wait out the rest of it. The
scheduler asks the worker to stop it (Worker.Interrupt, answered on a gRPC handler thread while the compute thread
runs the step), and the forward checks before each layer: the request then waits for a layer, not a step."""
from __future__ import annotations

from collections.abc import Iterable, Iterator


class StepInterrupted(Exception):
    """Raised before a layer of a step the scheduler asked to stop."""


class Interrupts:
    def __init__(self) -> None:
        self.asked = 0   # the step the scheduler last asked to stop; written by a handler thread, read between layers

    def ask(self, step_id: int) -> None:
        self.asked = step_id

    def layers(self, layers: Iterable, step_id: int) -> Iterator:
        """layers (each one's KV caches), handed to the model's forward one at a time; StepInterrupted before the
        next one once step_id was asked to stop, even before the step began."""
        for layer in layers:
            if self.asked == step_id:
                raise StepInterrupted(step_id)
            yield layer
