"""Ferry: continuous batching over a paged KV cache, served as router, scheduler and worker."""
from base.config import EngineConfig
from base.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # Engine pulls in torch: imported on first use so that `ferry up` starts quickly.
    if name == "Engine":
        from ferry.engine import Engine
        return Engine
    raise AttributeError(name)
