"""The shared-memory files of a KV pull do not outlive their owner: a puller's probe (which tells a holder on the
same host to hand chunks over in /dev/shm) lives for one pull, and the files a killed scheduler left are swept by
the next one to start, or by a holder on that host."""
from __future__ import annotations

import os
import time

import pytest

from scheduler import kv_transfer
from scheduler.kv_transfer import KvPulls, remove_stale_files, shares_memory, shm_probe


@pytest.fixture
def shm(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_transfer, "SHM_DIR", str(tmp_path))
    return tmp_path


def aged(path, seconds: float):
    path.touch()
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_the_probe_is_seen_by_a_holder_during_the_pull_and_gone_after_it(shm):
    with shm_probe() as probe:
        assert probe.startswith("ferry-probe-") and shares_memory(probe)
    assert not shares_memory(probe) and list(shm.iterdir()) == []


def test_a_pull_that_fails_removes_its_probe(shm):
    with pytest.raises(RuntimeError), shm_probe():
        raise RuntimeError("the peer went away")
    assert list(shm.iterdir()) == []


def test_without_shared_memory_there_is_no_probe(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_transfer, "SHM_DIR", str(tmp_path / "absent"))
    with shm_probe() as probe:
        assert probe == "" and not shares_memory(probe)
    remove_stale_files()   # nothing to sweep, and no error


def test_stale_probes_and_chunks_are_swept_and_fresh_ones_and_other_files_kept(shm):
    old = kv_transfer.STALE_SHM_S + 10
    stale = [aged(shm / "ferry-probe-dead", old), aged(shm / "ferry-kv-dead", old)]
    kept = [aged(shm / "ferry-probe-live", 1), aged(shm / "ferry-kv-live", 1), aged(shm / "someone-else", old)]
    remove_stale_files()
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)


def test_a_starting_puller_sweeps_what_a_killed_one_left(shm):
    left = aged(shm / "ferry-probe-killed", kv_transfer.STALE_SHM_S + 10)
    KvPulls(loop=None, scheduler_id="s0")
    assert not left.exists() and list(shm.iterdir()) == []   # and it leaves no probe of its own between pulls
