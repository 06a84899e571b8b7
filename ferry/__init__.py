"""Ferry: continuous batching over a paged KV cache, served as router, scheduler and worker."""
from ferry.config import EngineConfig
from ferry.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # Engine pulls in torch; the router imports ferry without it.
    if name == "Engine":
        from ferry.engine import Engine
        return Engine
    raise AttributeError(name)
