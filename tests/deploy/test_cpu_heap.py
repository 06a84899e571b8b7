"""The CPU worker's heap setting: a freed activation's memory is reused, not faulted in again page by page."""
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from gpu_worker.cpu import cpu_heap
if sys.argv[1] == "on":
    assert cpu_heap.keep_freed_memory()
def layers():
    x = torch.ones(12 << 20)   # 48 MiB activations; each layer's output is allocated before its input is freed
    for _ in range(8):
        x = x * 1.5
layers()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    layers()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
"""


def faults_per_pass(setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, setting], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activation_memory_is_reused_without_page_faults():
    default, kept = faults_per_pass("off"), faults_per_pass("on")
    # glibc's default mmaps anything above 32 MiB afresh: all 8 x 12,288 pages faulted in again every pass
    assert default >= 8 * 12288
    assert kept * 4 < default
