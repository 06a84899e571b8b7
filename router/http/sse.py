"""Server-sent events: a stream's chunks as `data:` lines, an error after the status line as an event, [DONE]."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from protos import router_pb2
from router.http.errors import api_error
from router.http.formats import ResponseFormat


def sse(payload: dict[str, Any] | str) -> bytes:
    """One event; orjson, because a streamed token costs a chunk's encoding (several times json's speed)."""
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


async def format_chunks(responses: AsyncIterator[router_pb2.GenerateResponse], fmt: ResponseFormat,
                        num_samples: int) -> AsyncIterator[dict[str, Any]]:
    """The format's chunks of a response stream: its opening ones, then one for each response that carries some."""
    async with contextlib.aclosing(responses):
        for chunk in fmt.opening_chunks(num_samples):
            yield chunk
        async for response in responses:
            chunk = fmt.chunk(response)
            if chunk is not None:
                yield chunk


async def sse_stream(chunks: AsyncIterator[dict[str, Any]],
                     usage_chunk: Callable[[], dict[str, Any]] | None) -> AsyncIterator[bytes]:
    """The chunks as events, then the usage chunk where the client asked for one, then [DONE]."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse(chunk)
            if usage_chunk is not None:
                yield sse(usage_chunk())
        except Exception as e:    # the status line has gone out: the error travels as an event
            yield sse(api_error(e).body())
    yield sse("[DONE]")


def sse_events(responses: AsyncIterator[router_pb2.GenerateResponse], fmt: ResponseFormat,
               num_samples: int) -> AsyncIterator[bytes]:
    return sse_stream(format_chunks(responses, fmt, num_samples), fmt.usage_chunk if fmt.include_usage else None)
