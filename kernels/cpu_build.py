"""Compiles Ferry's C++ CPU kernels on first use (torch's extension builder; the result is cached on disk).

FERRY_CPU_KERNELS=0 turns them all off; a build failure turns one off. Either way the callers use torch ops.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent / "csrc"


def build(name: str, source: str, extra_cflags: list[str]) -> ModuleType | None:
    if os.environ.get("FERRY_CPU_KERNELS", "1") == "0":
        return None
    # the build runs ninja, which pip installs beside this interpreter when the system has none
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load
        return load(name=name, sources=[str(SOURCES / source)], extra_cflags=["-O3", "-march=native", *extra_cflags],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("C++ kernel %s unavailable, using torch ops: %s", name, error)
        return None
