"""`ferry up --prefill-schedulers P --decode-schedulers D`: P + D schedulers, the first P prefill and the rest
decode; flags that do not make such a stack are refused before anything starts."""
from __future__ import annotations

import pytest

import ferry.launcher
from ferry.cli import build_parser as ferry_parser
from ferry.launcher import disaggregated_count, scheduler_role


def up_args(*flags: str):
    return ferry_parser().parse_args(["up", "--device", "cpu", *flags])


def test_prefill_schedulers_come_first_then_decode_ones():
    args = up_args("--prefill-schedulers", "1", "--decode-schedulers", "2")
    assert disaggregated_count(args) == 3
    assert [scheduler_role(args, i) for i in range(3)] == ["prefill", "decode", "decode"]


def test_without_them_every_scheduler_does_both():
    args = up_args("--num-schedulers", "2")
    assert disaggregated_count(args) is None and scheduler_role(args, 1) == "both"


@pytest.mark.parametrize("flags, refused", [
    (("--prefill-schedulers", "1"), "go together"),
    (("--prefill-schedulers", "1", "--decode-schedulers", "1", "--num-schedulers", "3"), "leave it out"),
])
def test_flags_that_make_no_such_stack_are_refused_before_anything_starts(monkeypatch, capsys, flags, refused):
    def no_stack():
        raise AssertionError("a stack was started")

    monkeypatch.setattr(ferry.launcher, "Stack", no_stack)
    args = up_args(*flags)
    assert args.handler(args) == 2
    assert refused in capsys.readouterr().err
