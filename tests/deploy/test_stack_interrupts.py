"""`ferry up`'s stack of processes: a SIGTERM that lands while a process is being started stops the stack with that
process in it, never leaving it running unrecorded (and so never stopped)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ferry.stack import Stack


def test_a_sigterm_while_a_process_starts_stops_the_stack_with_that_process_in_it(monkeypatch):
    stack = Stack()
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args, **kwargs):   # the signal lands after the fork, before Popen returns
        process = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return process

    monkeypatch.setattr(subprocess, "Popen", popen_then_sigterm)
    previous = signal.signal(signal.SIGTERM, stack.interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            stack.start([sys.executable, "-c", "import time; time.sleep(60)"], "sleeper")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(stack.processes) == 1
    stack.stop(timeout=5)
    assert stack.processes[0].poll() is not None


def test_a_sigterm_outside_a_start_interrupts_at_once():
    stack = Stack()
    with pytest.raises(KeyboardInterrupt):
        stack.interrupt()
