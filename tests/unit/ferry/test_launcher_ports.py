"""The ports `ferry up` hands out: the OS may give a port out again until a process binds it, and Redis binds its
own after the schedulers' ports are picked (a CI run had Redis and a scheduler both on one port)."""
from __future__ import annotations

from ferry import launcher


def test_ports_handed_out_in_one_start_are_distinct_and_not_those_taken_already(monkeypatch):
    offered = iter([41000, 41000, 41001, 41002, 41003])   # what the OS answers, twice the same in a row
    monkeypatch.setattr(launcher, "free_port", lambda: next(offered))
    assert launcher.free_ports(2, avoid=[41001]) == [41000, 41002]
