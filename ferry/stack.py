"""The processes of a stack on one machine, each in its own process group, stopped together."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field


@dataclass
class Stack:
    """Every process `ferry up` started, each in its own process group (a scheduler's group holds its worker)."""
    processes: list[subprocess.Popen] = field(default_factory=list)
    redis: subprocess.Popen | None = None   # the redis-server it started, if any: stopped last
    starting: bool = False      # inside start(): an interrupt waits until the new process is recorded
    interrupted: bool = False

    def interrupt(self, *_) -> None:
        """`ferry up`'s SIGTERM and SIGINT handler: KeyboardInterrupt, which stops the stack; not while a process
        is being started, which it would leave running and unrecorded, so never stopped: then once it is recorded."""
        if self.starting:
            self.interrupted = True
            return
        raise KeyboardInterrupt

    def start(self, args: list[str], name: str, stdin_text: str = "", stops_last: bool = False,
              **popen_kwargs) -> subprocess.Popen:
        """stdin_text: written to the process's standard input, which is then closed (secrets stay off argv);
        stops_last: Redis, which the services deregister from on their way out."""
        if stdin_text:
            popen_kwargs["stdin"] = subprocess.PIPE
        self.starting = True
        try:
            process = subprocess.Popen(args, start_new_session=True, **popen_kwargs)
            self.processes.append(process)
        finally:
            self.starting = False
            if self.interrupted:
                raise KeyboardInterrupt
        if stdin_text:
            process.stdin.write(stdin_text.encode())
            process.stdin.close()
        if stops_last:
            self.redis = process
        print(f"[ferry] started {name} (pid {process.pid})", flush=True)
        return process

    def forget(self, process: subprocess.Popen) -> None:
        """A process that exited and is being replaced."""
        self.processes.remove(process)
        if self.redis is process:
            self.redis = None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the services together (a scheduler drains, then stops its own worker), then Redis, which they
        deregister from on the way out; SIGKILL what is left of a process group after timeout."""
        redis = [p for p in self.processes if p is self.redis]
        services = [p for p in self.processes if p is not self.redis]
        deadline = time.monotonic() + timeout
        for group in (services, redis):
            for process in reversed(group):
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in group:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                signal_group(process, signal.SIGKILL)   # whatever is left of the group (a worker, say)
                process.wait()

    def any_exited(self) -> subprocess.Popen | None:
        return next((p for p in self.processes if p.poll() is not None), None)

    def why_exited(self) -> str | None:
        exited = self.any_exited()
        return None if exited is None else f"process {exited.pid} exited with code {exited.returncode} during start-up"


def signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
