"""`ferry up`'s supervisor: a child that dies is started again after a backoff, with what was left of its
process group killed first; one that keeps dying right after each start stops the stack."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from ferry.stack import Stack
from ferry.supervisor import Supervisor
from tests.services_fixtures import wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# a service whose own child (as a scheduler's worker) shares its process group; prints the child's pid
PARENT_OF_SLEEPER = [sys.executable, "-c", "import subprocess, sys, time\n"
                     "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                     "print(child.pid, flush=True); time.sleep(60)"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def supervise_until(supervisor: Supervisor, predicate, what: str) -> None:
    def checked() -> bool:
        assert supervisor.check(time.monotonic()) is None
        return predicate()

    wait_until(checked, what, timeout=20)


def test_a_killed_child_is_started_again_and_its_group_cleared_first():
    supervisor = Supervisor(Stack(), backoff_s=0.2)
    try:
        peer = supervisor.start(SLEEPER, "peer")
        service = supervisor.start(PARENT_OF_SLEEPER, "service", stdout=subprocess.PIPE, text=True)
        orphan = int(service.stdout.readline())
        os.kill(service.pid, signal.SIGKILL)
        restarted = supervisor.children[1]
        supervise_until(supervisor, lambda: restarted.process is not service and restarted.process.poll() is None,
                        "the service runs again")
        assert not alive(orphan)                 # its old child went with it
        assert peer.poll() is None               # its peer kept running
        assert restarted.process in supervisor.stack.processes and service not in supervisor.stack.processes
    finally:
        supervisor.stack.stop(timeout=5)
    assert all(p.poll() is not None for p in supervisor.stack.processes)


def test_a_child_that_dies_at_every_start_stops_the_stack_after_backing_off(capsys):
    supervisor = Supervisor(Stack(), backoff_s=0.05, quick_exit_s=10, max_quick_exits=3)
    supervisor.start(SLEEPER, "peer")
    supervisor.start([sys.executable, "-c", "import sys; sys.exit(3)"], "crasher")
    try:
        reason = supervisor.run(poll_s=0.01)
    finally:
        supervisor.stack.stop(timeout=5)
    assert "crasher exited with code 3, 4 times in a row" in reason
    printed = capsys.readouterr().out
    assert printed.count("[ferry] started crasher") == 4
    assert re.findall(r"crasher .* restarting it in ([\d.]+) s", printed) == ["0.05", "0.1", "0.2"]   # doubling


def test_an_exit_long_after_its_start_restarts_without_counting_towards_a_crash_loop():
    supervisor = Supervisor(Stack(), backoff_s=0.05, quick_exit_s=0.0, max_quick_exits=1)
    try:
        for _ in range(3):
            child = supervisor.start(SLEEPER, "service") if not supervisor.children else supervisor.children[0].process
            child.kill()
            supervise_until(supervisor, lambda: supervisor.children[0].process.poll() is None and
                            supervisor.children[0].process is not child, "the service runs again")
        assert supervisor.children[0].quick_exits == 1
    finally:
        supervisor.stack.stop(timeout=5)
