"""The event loop Ferry's services run on: uvloop (libuv) where it is installed, else asyncio's own. Python gRPC's
per-message cost is mostly event-loop work, and on uvloop the router relays a token for less CPU (BENCHMARKS.md,
issue 21). FERRY_EVENT_LOOP=asyncio picks asyncio's loop, to compare or to rule uvloop out."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from base import environment

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the chosen loop."""
    if environment.FERRY_EVENT_LOOP != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
