"""Host values onto the step's device without waiting for it.

A plain copy from pageable host memory to a GPU waits for every kernel already queued on the stream: one in the
middle of a step would hold the host until the previous step's forward is done, and the next step could not be
launched while one runs. Through pinned memory the copy is queued like a kernel and the host goes on. On a CPU
the host tensor is the device tensor."""
from __future__ import annotations

import torch


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host, pinned where device is a GPU: a copy_(..., non_blocking=True) from it into a device tensor is then
    queued, not waited for."""
    return host.pin_memory() if device.type == "cuda" else host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host
    if host.device.type != "cpu":   # already on a GPU (a caller's device tensors): nothing to stage
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), queued without waiting on a GPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)
