"""Every FERRY_* environment variable, declared once (vLLM's envs.py): its default and what it does.

Read one as an attribute, when it is needed: `environment.FERRY_CPU_KERNELS` reads the variable then, parsed
(a test or a benchmark may set it before the code that reads it runs). Nothing else in Ferry reads a FERRY_*
variable (tests/test_options.py checks). Deploy files, scripts and tests set them by these names.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Variable:
    default: str
    meaning: str
    parse: Callable[[str], Any] = str


def switch(value: str) -> bool:
    """On unless "0"."""
    return value != "0"


def optional_int(value: str) -> int | None:
    return int(value) if value else None


def cache_dir(value: str) -> Path:
    return Path(value) if value else Path.home() / ".cache" / "ferry"


VARIABLES: dict[str, Variable] = {
    # the services' defaults for their flags (the flag wins)
    "FERRY_REDIS_URL": Variable("", "--redis-url of python -m scheduler and python -m router"),
    "FERRY_ADVERTISE_HOST": Variable("", "--advertise-host of python -m scheduler: the address routers dial "
                                         "(in Kubernetes, the pod IP)"),
    "FERRY_METRICS_PORT": Variable("0", "--metrics-port of python -m scheduler", int),
    "FERRY_LOG_LEVEL": Variable("INFO", "--log-level of the scheduler, the router and the worker"),
    # secrets: kept out of argv, where other users of the host could read them
    "FERRY_CLUSTER_TOKEN": Variable("", "the token routers present to schedulers (--cluster-token)"),
    "FERRY_REDIS_PASSWORD": Variable("", "the password of the services' Redis (--redis-password)"),
    "FERRY_API_KEY": Variable("", "API keys clients must present to the router, comma-separated (--api-key)"),
    # the runtime
    "FERRY_EVENT_LOOP": Variable("uvloop", "the services' event loop: uvloop (where installed) or asyncio"),
    "FERRY_CACHE_DIR": Variable("", "where converted models are kept; empty: ~/.cache/ferry", cache_dir),
    # the CPU worker's fast paths, each on unless 0 (to compare, or to rule one out)
    "FERRY_CPU_KERNELS": Variable("1", "the compiled CPU kernels (kernels/cpu_build.py)", switch),
    "FERRY_CPU_PREFILL_KERNEL": Variable("1", "the CPU prefill attention kernel (else prefill rows go to the decode "
                                              "kernel)", switch),
    "FERRY_CPU_HUGEPAGES": Variable("1", "transparent huge pages for the CPU KV pool", switch),
    "FERRY_CPU_PACKED_LINEAR": Variable("1", "prepacked fp32 linear weights on the CPU", switch),
    "FERRY_CPU_HEAP_CACHE": Variable("1", "glibc heap tuning that keeps freed activations cached", switch),
    "FERRY_CPU_GGUF_BLOCKS": Variable("1", "GGUF Q8_0 weights kept in blocks, multiplied by a CPU kernel", switch),
    # tests only
    "FERRY_TEST_CRASH_ON_TOKEN": Variable("", "the worker kills itself at a step holding this prompt token id "
                                              "(gpu_worker/fault.py)", optional_int),
}


def value(name: str) -> Any:
    """The variable's value now, parsed; its default where it is unset."""
    variable = VARIABLES[name]
    return variable.parse(os.environ.get(name, variable.default))


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return value(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
