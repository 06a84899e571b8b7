"""`ferry up` with --tensor-parallel-size N: the visible GPUs in consecutive groups of N, one scheduler per group,
its worker's ranks pinned to the group with CUDA_VISIBLE_DEVICES; a layout that cannot be met is refused before
anything starts."""
from __future__ import annotations

import pytest

import ferry.launcher
from ferry.cli import build_parser as ferry_parser
from ferry.launcher import scheduler_envs, visible_gpus


def pinned(envs: list[dict[str, str]]) -> list[str]:
    return [env["CUDA_VISIBLE_DEVICES"] for env in envs]


def test_eight_gpus_in_pairs_make_four_schedulers():
    gpus = [str(i) for i in range(8)]
    assert pinned(scheduler_envs(None, gpus, 2)) == ["0,1", "2,3", "4,5", "6,7"]
    assert pinned(scheduler_envs(None, gpus, 8)) == ["0,1,2,3,4,5,6,7"]
    assert pinned(scheduler_envs(2, gpus, 4)) == ["0,1,2,3", "4,5,6,7"]


def test_groups_follow_the_order_of_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert pinned(scheduler_envs(None, visible_gpus("cuda"), 2)) == ["3,5", "6,7"]


def test_fewer_schedulers_than_groups_take_the_first_groups():
    assert pinned(scheduler_envs(1, ["0", "1", "2", "3"], 2)) == ["0,1"]


def test_a_gpu_too_few_for_a_group_is_left_unused_and_said_so(capsys):
    assert pinned(scheduler_envs(None, ["0", "1", "2"], 2)) == ["0,1"]
    assert "GPU(s) 2 left unused" in capsys.readouterr().err


def test_more_schedulers_than_groups_is_refused():
    with pytest.raises(ValueError, match="--num-schedulers 3 with 4 GPU.* groups of --tensor-parallel-size 2"):
        scheduler_envs(3, ["0", "1", "2", "3"], 2)


def test_a_group_larger_than_the_visible_gpus_is_refused():
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 with 2 GPU"):
        scheduler_envs(None, ["0", "1"], 4)


def test_on_the_cpu_the_schedulers_share_the_cores_whatever_the_group_size():
    assert scheduler_envs(None, [], 2) == [{}, {}]
    assert scheduler_envs(3, [], 4) == [{}, {}, {}]


def test_ferry_up_refuses_an_impossible_layout_before_starting_anything(monkeypatch, capsys):
    def no_stack():
        raise AssertionError("a stack was started")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(ferry.launcher, "Stack", no_stack)
    args = ferry_parser().parse_args(["up", "--device", "cuda", "--tensor-parallel-size", "2", "--num-schedulers", "3"])
    assert args.handler(args) == 2
    assert "ferry up: error: --num-schedulers 3 with 4 GPU(s)" in capsys.readouterr().err


def test_the_start_line_names_the_groups_gpus():
    assert ferry.launcher.on_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == " on GPUs 2,3"
    assert ferry.launcher.on_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == " on GPU 1"
    assert ferry.launcher.on_gpus({}) == ""
