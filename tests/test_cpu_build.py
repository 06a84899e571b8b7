"""Kernel builds survive a builder killed mid-compile, and never run two at once in one build directory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from kernels.cpu_build import build_lock

HOLD_THE_LOCK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kernels.cpu_build import build_lock
    directory = Path(sys.argv[1])
    with build_lock(directory):
        (directory / "lock").write_text("torch's baton, as a builder leaves it while it compiles")
        print("holding", flush=True)
        time.sleep(60)
""")


def start_holder(directory: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(directory)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[1])
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_builder_killed_mid_compile_leaves_no_lock_that_blocks_the_next(tmp_path):
    holder = start_holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "lock").exists()   # what used to hang every later worker start
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_second_builder_waits_until_the_first_is_gone(tmp_path):
    holder = start_holder(tmp_path)
    entered = threading.Event()

    def second_builder():
        with build_lock(tmp_path):
            entered.set()

    waiter = threading.Thread(target=second_builder, daemon=True)
    try:
        waiter.start()
        assert not entered.wait(timeout=1.0)   # the first still builds
        assert (tmp_path / "lock").exists()    # and its files are left alone meanwhile
    finally:
        holder.kill()
        holder.wait()
    assert entered.wait(timeout=10)
    waiter.join()
