"""`ferry up` keeps its stack running: a child that dies (scheduler, router, redis-server) is started again with
the same command after a backoff while its peers keep serving. The stack stops on SIGTERM / Ctrl-C, or when a
child keeps dying soon after each start (a crash loop no restart will mend)."""
from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ferry.stack import Stack, signal_group


@dataclass
class Child:
    name: str
    launch: Callable[[], subprocess.Popen]
    process: subprocess.Popen
    started_at: float
    quick_exits: int = 0               # exits in a row, each soon after its start
    restart_at: float | None = None    # set while it waits out its backoff


@dataclass
class Supervisor:
    stack: Stack
    backoff_s: float = 1.0             # the first restart's delay, doubled for each quick exit in a row
    max_backoff_s: float = 30.0
    quick_exit_s: float = 60.0         # an exit this soon after a start counts towards a crash loop
    max_quick_exits: int = 5
    children: list[Child] = field(default_factory=list)

    def start(self, args: list[str], name: str, stops_last: bool = False, **start_kwargs) -> subprocess.Popen:
        """Stack.start, remembered so that the child can be started again; stops_last: Redis, which the
        services deregister from on their way out."""
        def launch() -> subprocess.Popen:
            return self.stack.start(args, name, stops_last=stops_last, **start_kwargs)

        process = launch()
        self.children.append(Child(name, launch, process, time.monotonic()))
        return process

    def run(self, poll_s: float = 0.5) -> str:
        """Watch the children until one is in a crash loop; returns why the stack must stop."""
        while (reason := self.check(time.monotonic())) is None:
            time.sleep(poll_s)
        return reason

    def check(self, now: float) -> str | None:
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self.restart(child, now)
            elif child.process.poll() is not None:
                reason = self.note_exit(child, now)
                if reason is not None:
                    return reason
        return None

    def note_exit(self, child: Child, now: float) -> str | None:
        """Schedules the restart of a child that exited, or says why it will not be restarted."""
        signal_group(child.process, signal.SIGKILL)   # what is left of its group: a scheduler's worker, say
        code = child.process.returncode
        child.quick_exits = child.quick_exits + 1 if now - child.started_at < self.quick_exit_s else 1
        if child.quick_exits > self.max_quick_exits:
            return (f"{child.name} exited with code {code}, {child.quick_exits} times in a row within "
                    f"{self.quick_exit_s:g} s of starting; stopping")
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (child.quick_exits - 1))
        print(f"[ferry] {child.name} (pid {child.process.pid}) exited with code {code}; restarting it in "
              f"{delay:g} s", flush=True)
        child.restart_at = now + delay
        return None

    def restart(self, child: Child, now: float) -> None:
        self.stack.forget(child.process)
        child.process = child.launch()
        child.started_at, child.restart_at = now, None
