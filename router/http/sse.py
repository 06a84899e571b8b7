"""Server-sent events: a stream's chunks as `data:` lines, an error after the status line as an event, [DONE]."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson

from protos import router_pb2
from router.http.errors import api_error
from router.http.formats import ResponseFormat


def sse(payload: dict[str, Any] | str) -> bytes:
    """One event; orjson, because a streamed token costs a chunk's encoding (several times json's speed)."""
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


async def sse_events(responses: AsyncIterator[router_pb2.GenerateResponse], fmt: ResponseFormat,
                     num_samples: int) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(responses):
        try:
            for chunk in fmt.opening_chunks(num_samples):
                yield sse(chunk)
            async for response in responses:
                chunk = fmt.chunk(response)
                if chunk is not None:
                    yield sse(chunk)
            if fmt.include_usage:
                yield sse(fmt.usage_chunk())
        except Exception as e:    # the status line has gone out: the error travels as an event
            yield sse(api_error(e).body())
    yield sse("[DONE]")
