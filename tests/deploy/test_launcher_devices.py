"""`ferry up` on GPUs: one scheduler per visible GPU, its worker pinned to it; on the CPU two by default."""
from __future__ import annotations

import pytest
import torch

from ferry.launcher import scheduler_envs, visible_gpus


def test_each_scheduler_gets_a_gpu_of_its_own_from_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0, 3,5,7")
    gpus = visible_gpus("auto")
    assert gpus == ["0", "3", "5", "7"]
    assert scheduler_envs(None, gpus) == [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in gpus]
    assert scheduler_envs(2, gpus) == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    with pytest.raises(ValueError, match="5 with 4 GPU"):
        scheduler_envs(5, gpus)


def test_without_cuda_visible_devices_every_gpu_torch_sees_gets_a_scheduler(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert len(scheduler_envs(None, visible_gpus("cuda"))) == 8
    assert visible_gpus("cpu") == []


def test_on_the_cpu_two_schedulers_share_the_cores_unless_told(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus("auto") == []
    assert scheduler_envs(None, []) == [{}, {}]
    assert scheduler_envs(3, []) == [{}, {}, {}]
