"""Kernel builds survive a builder killed mid-compile, never run two at once in one build directory, and follow
edits of the headers the sources share."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

from kernels import cpu_build
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
                              cwd=Path(__file__).parents[2])
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


def test_editing_a_shared_header_changes_what_torch_keys_the_cached_build_on(tmp_path, monkeypatch):
    """torch hashes the sources and flags it is given, not the headers they include: an edited header must show in
    the flags, or the stale build stays in use."""
    calls = []
    monkeypatch.delenv("FERRY_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_build, "SOURCES", tmp_path)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / "build"))
    monkeypatch.setattr(cpp_extension, "load", lambda **arguments: calls.append(arguments))
    (tmp_path / "kernel.cpp").write_text('#include "shared.h"\n')
    header = tmp_path / "shared.h"
    header.write_text("inline int twice(int x) { return 2 * x; }\n")
    cpu_build.build("ferry_test_kernel", "kernel.cpp", [])
    cpu_build.build("ferry_test_kernel", "kernel.cpp", [])
    header.write_text("inline int twice(int x) { return x + x; }\n")
    cpu_build.build("ferry_test_kernel", "kernel.cpp", [])
    first, unchanged, edited = (call["extra_cflags"] for call in calls)
    assert first == unchanged
    assert first != edited


def test_two_checkouts_build_in_folders_of_their_own(tmp_path, monkeypatch):
    """ninja's build file names the sources by path: one shared folder would make a worktree and a CI clone rebuild
    each other's extension at every worker start."""
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / "build" / name))
    folders = []
    for checkout in ("one", "two", "one"):
        monkeypatch.setattr(cpu_build, "SOURCES", tmp_path / checkout / "kernels" / "csrc")
        folders.append(cpu_build.build_directory("ferry_test_kernel"))
    assert folders[0] == folders[2] != folders[1]
    assert all(folder.parent == tmp_path / "build" / "ferry_test_kernel" for folder in folders)
