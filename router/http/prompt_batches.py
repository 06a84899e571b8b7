"""A completion request with a batch of prompts (OpenAI's `prompt` as a list of strings or of token-id lists, as
lm-eval-harness sends them): each prompt runs as a request of its own, side by side, and the answers come back as
one, prompt i's sample j as choice i * n + j, their usage summed; streamed, the prompts' chunks interleave as they
come."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from protos import router_pb2
from router.http.formats import ResponseFormat, usage_json
from router.http.sse import format_chunks, sse_stream
from router.http.streams import started



def reindexed(chunk: dict[str, Any], offset: int) -> dict[str, Any]:
    """The chunk or body with its choices' indexes moved on by offset (in place)."""
    for choice in chunk["choices"]:
        choice["index"] += offset
    return chunk


def summed_usage(usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    if any(usage is None for usage in usages):
        return None
    total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}


def merged_body(bodies: list[dict[str, Any]], num_samples: int) -> dict[str, Any]:
    """The prompts' whole answers as one."""
    merged = dict(bodies[0])
    merged["choices"] = [choice for i, body in enumerate(bodies)
                         for choice in reindexed(body, i * num_samples)["choices"]]
    merged["usage"] = summed_usage([body["usage"] for body in bodies])
    return merged


async def all_started(streams: list[AsyncIterator[router_pb2.GenerateResponse]]
                      ) -> list[AsyncIterator[router_pb2.GenerateResponse]]:
    """Every prompt's stream started side by side; one refused refuses the batch (the others are closed)."""
    results = await asyncio.gather(*map(started, streams), return_exceptions=True)
    refused = next((r for r in results if isinstance(r, BaseException)), None)
    if refused is None:
        return results
    for result in results:
        if not isinstance(result, BaseException):
            await result.aclose()
    raise refused


async def merged_chunks(streams: list[AsyncIterator[router_pb2.GenerateResponse]], formats: list[ResponseFormat],
                        num_samples: int) -> AsyncIterator[dict[str, Any]]:
    """The prompts' chunks as each stream gives them; the first error ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(i: int) -> None:
        try:
            async with contextlib.aclosing(format_chunks(streams[i], formats[i], num_samples)) as chunks:
                async for chunk in chunks:
                    await queue.put(reindexed(chunk, i * num_samples))
        except Exception as e:
            await queue.put(e)
        finally:
            await queue.put(finished)

    pumps = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        running = len(pumps)
        while running:
            item = await queue.get()
            if item is finished:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def batch_sse_events(streams: list[AsyncIterator[router_pb2.GenerateResponse]], formats: list[ResponseFormat],
                     num_samples: int) -> AsyncIterator[bytes]:
    """sse_events for a batch: one stream of events, one usage chunk at the end (summed)."""
    def usage_chunk() -> dict[str, Any]:
        usage = summed_usage([usage_json(fmt.usage) for fmt in formats])
        return formats[0].envelope(formats[0].chunk_object, [], usage=usage)
    return sse_stream(merged_chunks(streams, formats, num_samples), usage_chunk if formats[0].include_usage else None)
