"""Keeps a CPU worker's freed activations in the process heap instead of handing them back to the OS.

glibc serves large allocations (above 128 KiB, or a threshold that floats up to 32 MiB) with fresh mmaps and
gives much of that memory back on free, so activations of a few MiB are faulted in again page by page, step
after step: the `mixed` benchmark took 454k page faults (~1.4 us each), 38k with this setting. Raising the mmap
and trim thresholds (what tcmalloc does by design) makes the heap keep and reuse that memory; it grows to a
step's peak and stays there. The KV pool, larger than the threshold, still gets its own mapping.
FERRY_CPU_HEAP_CACHE=0 leaves glibc's defaults.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

from base import environment

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Raises glibc's thresholds for this process; returns whether both were taken (False off glibc)."""
    if not environment.FERRY_CPU_HEAP_CACHE:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    taken = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
             and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not taken:
        log.info("glibc refused the heap thresholds; freed CPU activations go back to the OS")
    return taken
