"""A client that hangs up while its whole answer is being collected cancels the work (and so the upstream call)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    pass


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run work; cancel it (and so the upstream stream) if the client hangs up first."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()
