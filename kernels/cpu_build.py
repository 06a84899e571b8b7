"""Compiles Ferry's C++ CPU kernels on first use (torch's extension builder; the result is cached on disk).

FERRY_CPU_KERNELS=0 turns them all off; a build failure turns one off. Either way the callers use torch ops.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from base import environment

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "csrc"


def build(name: str, source: str, extra_cflags: list[str]) -> ModuleType | None:
    if not environment.FERRY_CPU_KERNELS:
        return None
    # the build runs ninja, which pip installs beside this interpreter when the system has none
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load
        directory = build_directory(name)
        with build_lock(directory):
            flags = ["-O3", "-march=native", *extra_cflags, f"-DFERRY_HEADERS_DIGEST={headers_digest(SOURCES)}"]
            return load(name=name, sources=[str(SOURCES / source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                        build_directory=str(directory), verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("C++ kernel %s unavailable, using torch ops: %s", name, error)
        return None


def build_directory(name: str) -> Path:
    """torch's build folder for name, one below it per checkout: ninja's build file names the sources by path, so
    two checkouts (worktrees, a CI clone) sharing one folder would rebuild each other's extension at every start."""
    from torch.utils.cpp_extension import _get_build_directory
    checkout = hashlib.sha256(str(SOURCES.resolve()).encode()).hexdigest()[:12]
    return Path(_get_build_directory(name, verbose=False)) / checkout


def headers_digest(directory: Path) -> str:
    """A digest of the shared headers (csrc/*.h), passed to the build as a flag. torch keys its build cache on the
    sources and flags it is given, and the headers are neither: without it, an edited header could leave a stale
    build in use (ninja's dependency log catches it only where that log survives)."""
    digest = hashlib.sha256()
    for header in sorted(directory.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:16]


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """One builder at a time, by a lock the OS drops when its holder dies. torch's own lock is a file that a process
    killed mid-build (a worker stopped while it compiled) leaves behind, and every later build waits on it forever:
    whoever holds this lock knows such a file is stale and removes it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "ferry.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
