"""`python -m router --workers N`: N router processes behind one gRPC and one HTTP address.

Each worker is a whole router (`python -m router` with the same flags) that binds the same ports with SO_REUSEPORT,
so the kernel spreads incoming connections across them; the router is stateless, so any worker can serve any
request (each keeps its own Connect stream per scheduler). This parent only starts them, passes SIGTERM / SIGINT
on (each drains its own streams) and, when one exits, stops the others and exits with its status, for the
supervisor above (compose, Kubernetes, ferry up) to restart the set.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def worker_argv(argv: list[str]) -> list[str]:
    """argv without its --workers flag (`--workers N` or `--workers=N`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def run_workers(num_workers: int, argv: list[str]) -> int:
    """Start num_workers routers with argv (the parent's own flags, --workers removed) and wait for them."""
    command = [sys.executable, "-m", "router", *worker_argv(argv), "--reuse-port"]
    return supervise([command] * num_workers)


def supervise(commands: list[list[str]]) -> int:
    """Run the commands, pass SIGTERM / SIGINT on, and when one exits stop the rest.

    Returns the status of the worker that exited first (the cause), else the first nonzero status of the others."""
    workers = [subprocess.Popen(command) for command in commands]
    signalled: set[int] = set()

    def stop(signum, _frame) -> None:
        # Once only per worker: a second SIGTERM can land after the worker's event loop closed and put the default
        # handler back, killing a worker that was exiting cleanly.
        for worker in workers:
            if worker.poll() is None and worker.pid not in signalled:
                signalled.add(worker.pid)
                worker.send_signal(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while (first := next((w for w in workers if w.poll() is not None), None)) is None:
            time.sleep(0.2)
        stop(signal.SIGTERM, None)
        codes = [first.returncode] + [worker.wait() for worker in workers if worker is not first]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return next((code for code in codes if code), 0)


def children_of(pid: int) -> list[int]:
    """The live child processes of pid (its workers), from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids
